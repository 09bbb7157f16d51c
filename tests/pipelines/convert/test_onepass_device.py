"""``capture --device`` and ``convert --calibrate-on --device`` on a SIMULATED MPS device (no
float64 on it, as the real one; numerics are the CPU's): the forward and the statistics run
there, the float64 channel sums on the host, and the results equal a CPU run's."""

import pytest
import torch
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.pipelines.convert import ConvertOptions, convert
from helpers.inputs import synth_world

TARGET = "int8-convrot"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return synth_world(tmp_path_factory.mktemp("device"), 5, 3)


@pytest.fixture
def mps(monkeypatch):
    from h3quant.runtime import probe
    from h3quant.testing.simdevice import simulated_mps

    with simulated_mps() as sim:
        monkeypatch.setattr(probe, "_LIVE", sim.probe)  # the machine the pipelines ask
        yield sim


def _read(path) -> dict[str, torch.Tensor]:
    with SafetensorsFile(path, mmap=False) as fh:
        return {n: fh.read(i).clone() for n, i in fh.tensors.items()}


def test_capture_on_a_device_without_float64(world, mps):
    from h3quant.pipelines.capture import capture_statistics

    d = world["d"]
    capture_statistics(world["src"], world["inputs"], d / "mps.stats", predict=False,
                       device="mps")
    assert mps.device.of_kind("to_device")  # the forward ran on the device
    cpu_stats = d / "cpu.stats"
    capture_statistics(world["src"], world["inputs"], cpu_stats, predict=False)
    a, b = _read(d / "mps.stats"), _read(cpu_stats)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".absmean"):  # float32 sums per call, then float64 on the host
            torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[name], b[name]), name


def test_one_pass_on_the_device(world, mps):
    d = world["d"]
    on = d / "mps.safetensors"
    rep = convert(world["src"], on, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],),
                                                   device="mps"))
    assert rep.extra["onepass"]["blocks"] and mps.device.of_kind("to_device")
    off = d / "cpu.safetensors"
    convert(world["src"], off, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],)))
    a, b = _read(on), _read(off)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_device_needs_the_one_pass(world, tmp_path):
    from h3quant.errors import ConvertError

    with pytest.raises(ConvertError, match="--device applies to --calibrate-on"):
        ConvertOptions(target=TARGET, device="mps")
    if torch.cuda.is_available():
        return  # the refusal below is of a machine without CUDA
    r = CliRunner().invoke(main, ["convert", str(world["src"]), str(tmp_path / "o.safetensors"),
                                  "--to", TARGET, "--calibrate-on", world["calib"], "--device",
                                  "cuda"])
    assert r.exit_code == 2 and "--device" in r.output and "cuda" in r.output
    assert list(tmp_path.iterdir()) == []
