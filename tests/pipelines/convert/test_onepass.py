"""``convert --calibrate-on``: one pass, block by block, against capture + convert --calibration;
killed after block 1 and resumed to the same bytes; changed inputs or options refused."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.errors import UsageError
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.convert.onepass import work_dir
from h3quant.synth import synth_checkpoint

from helpers.inputs import input_dims, seeded_inputs

TARGET = "int8-convrot"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("onepass")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=3)
    (d / "calib").mkdir()
    ins = seeded_inputs(d / "calib", input_dims(src), range(5))  # 5 x 256 rows >= K
    return {"d": d, "src": src, "inputs": ins}


def _tensors(path) -> dict[str, bytes]:
    with SafetensorsFile(path, mmap=False) as fh:
        return {n: fh.read_bytes(i, 0, i.nbytes) for n, i in fh.tensors.items()}


def _metadata(path) -> dict:
    with SafetensorsFile(path, mmap=False) as fh:
        return dict(fh.metadata)


def test_float_feedback_equals_capture_then_convert(world):
    """With float feedback the statistics are capture's: the same tensor bytes; the header
    differs only in the options it records."""
    from h3quant.pipelines.capture import capture_statistics

    d, src = world["d"], world["src"]
    capture_statistics(src, world["inputs"], d / "a.stats", predict=False)
    two = d / "two.safetensors"
    convert(src, two, ConvertOptions(target=TARGET, calibration=str(d / "a.stats")))
    one = d / "one_float.safetensors"
    logs = []
    rep = convert(src, one, ConvertOptions(target=TARGET, calibrate_on=(str(d / "calib"),)),
                  log=logs.append)  # float feedback: the default
    assert _tensors(one) == _tensors(two)
    m1, m2 = _metadata(one), _metadata(two)
    assert {k for k in set(m1) | set(m2) if m1.get(k) != m2.get(k)} == {"h3quant.options"}
    assert json.loads(m1["h3quant.options"])["calibrate_on"] == {"feedback": "float"}
    assert [t["block"] for t in rep.extra["onepass"]["blocks"]] == [0, 1]
    assert any(m.startswith("block 2/2: capture") and "ETA" in m for m in logs)
    assert not work_dir(one).exists()
    # uncalibrated rounding differs: the statistics did something
    near = d / "near.safetensors"
    convert(src, near, ConvertOptions(target=TARGET))
    assert _tensors(near) != _tensors(one)


_KILLER = r"""
import os, signal, sys
from h3quant.pipelines.convert import ConvertOptions, convert

def log(msg):
    print(msg, file=sys.stderr, flush=True)
    if msg.startswith("block 1/"):
        os.kill(os.getpid(), signal.SIGKILL)  # after block 1 is saved, before block 2 starts

convert(sys.argv[1], sys.argv[2], ConvertOptions(target=sys.argv[3], calibrate_on=(sys.argv[4],),
                                                  feedback="quantized"), log=log)
"""


def _killed_run(world, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    r = subprocess.run([sys.executable, "-c", _KILLER, str(world["src"]), str(out), TARGET,
                        str(world["d"] / "calib")], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not out.exists()
    state = json.loads((work_dir(out) / "state.json").read_text())
    assert [b["block"] for b in state["blocks"]] == [0]


@pytest.fixture(scope="module")
def killed(world):
    """A run killed (SIGKILL) after block 1 was saved."""
    out = world["d"] / "resumed.safetensors"
    _killed_run(world, out)
    return out


def test_changed_inputs_or_options_are_refused(world, killed, tmp_path):
    src, out = world["src"], killed
    calib = str(world["d"] / "calib")
    with pytest.raises(UsageError, match="options changed since the interrupted run: feedback"):
        convert(src, out, ConvertOptions(target=TARGET, calibrate_on=(calib,), feedback="float"))
    with pytest.raises(UsageError, match="options changed since the interrupted run: group_size"):
        convert(src, out, ConvertOptions(target=TARGET, calibrate_on=(calib,), group_size=64,
                                         feedback="quantized"))
    copy = tmp_path / "calib"
    copy.mkdir()
    for p in world["inputs"]:
        (copy / p.name).write_bytes(p.read_bytes())
    first = sorted(copy.iterdir())[0]
    from h3quant.calibration.recorder import write_inputs

    dims = input_dims(src)
    write_inputs(first, torch.zeros(1, dims["vc"], 2, 16, 16), torch.zeros(1, dims["ac"], 2, 32),
                 torch.zeros(1, 64, dims["td"]), 0.5)
    with pytest.raises(UsageError, match=f"input {first.name} changed"):
        convert(src, out, ConvertOptions(target=TARGET, calibrate_on=(str(copy),),
                                         feedback="quantized"))
    first.unlink()
    with pytest.raises(UsageError, match=f"input\\(s\\) gone \\({first.name}\\)"):
        convert(src, out, ConvertOptions(target=TARGET, calibrate_on=(str(copy),),
                                         feedback="quantized"))
    assert not out.exists() and (work_dir(out) / "state.json").exists()  # kept to resume


def test_killed_after_block_1_resumes_to_the_same_bytes(world, killed):
    d, src, out = world["d"], world["src"], killed
    whole = d / "whole.safetensors"
    r = CliRunner().invoke(main, ["convert", str(src), str(whole), "--to", TARGET,
                                  "--calibrate-on", str(d / "calib" / "*.safetensors"), "--json",
                                  "--feedback", "quantized"])
    assert r.exit_code == 0, r.output
    times = json.loads(r.stdout)["onepass"]
    assert times["feedback"] == "quantized" and len(times["blocks"]) == 2
    assert all(t[p] >= 0 for t in times["blocks"]
               for p in ("capture", "factorisation", "feedback", "write"))
    logs = []
    convert(src, out, ConvertOptions(target=TARGET, calibrate_on=(str(d / "calib"),),
                                     feedback="quantized"), log=logs.append)
    assert any(m.startswith("resuming") for m in logs)
    assert not any(m.startswith("block 1/") for m in logs)  # block 1 was not done again
    assert _tensors(out) == _tensors(whole)
    assert _metadata(out) == _metadata(whole)
    assert not work_dir(out).exists()
    if (d / "one_float.safetensors").exists():  # block 2 measured on other inputs
        assert _tensors(d / "one_float.safetensors") != _tensors(out)
