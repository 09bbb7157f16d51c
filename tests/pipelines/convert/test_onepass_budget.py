"""``--memory-budget`` for ``capture`` and ``convert --calibrate-on``: the hidden states' size is
printed (checked against a size computed here), a budget below one call is refused, a tiny budget
spills them to disk with the same bytes as an unbounded run, and the spill files are gone after
success and after SIGTERM (the one pass keeps only its last finished block's saved point)."""

import json
import math
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
from helpers.inputs import synth_world

TARGET = "int8-convrot"
CALLS = 5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = synth_world(tmp_path_factory.mktemp("budget"), 3, CALLS)
    src = w["src"]
    with SafetensorsFile(src, mmap=False) as fh:  # the model width, from the header
        hidden = int(fh.tensors["video_patch_proj.weight"].shape[0])
    # each inputs file: 64 text tokens, 32 audio frames (2 rows each), 2 x 16 x 16 video latents
    # in 2 x 2 patches: 64 + 64 + 2 * 8 * 8 = 256 rows of `hidden` float32 values
    rows = 64 + 2 * 32 + 2 * math.ceil(16 / 2) * math.ceil(16 / 2)
    call = rows * hidden * 4
    return {**w, "call": call}


def _tensors(path) -> dict[str, bytes]:
    with SafetensorsFile(path, mmap=False) as fh:
        return {n: fh.read_bytes(i, 0, i.nbytes) for n, i in fh.tensors.items()}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def test_capture_spills_to_the_same_bytes_and_prints_the_size(world):
    from h3quant.pipelines.capture import capture_statistics, spill_dir

    d, call = world["d"], world["call"]
    logs: list[str] = []
    capture_statistics(world["src"], world["inputs"], d / "all.stats", predict=False,
                       memory_budget=10**12, log=logs.append)
    assert f"hidden states: {_mb(CALLS * call)} for {CALLS} call(s)" in logs[0]
    assert "memory budget 1,000.00 GB: they fit in memory" in logs[0]
    logs.clear()
    budget = int(2.5 * call)  # one call kept, room for one read back: four spilled
    seen: set[str] = set()
    from h3quant.calibration import hidden

    real = hidden.HiddenStates._write

    def spy(self, gen, i, x):
        real(self, gen, i, x)
        seen.update(p.name for p in self.folder.iterdir())

    hidden.HiddenStates._write = spy
    try:
        capture_statistics(world["src"], world["inputs"], d / "spilled.stats", predict=False,
                           memory_budget=budget, log=logs.append)
    finally:
        hidden.HiddenStates._write = real
    assert f"memory budget {_mb(budget)}: they do not fit; 4 of {CALLS} call(s) spilled" \
        in logs[0]
    assert "hidden_001_0004.safetensors" in seen and "hidden_000_0000.safetensors" not in seen
    assert _tensors(d / "spilled.stats") == _tensors(d / "all.stats")
    assert not spill_dir(d / "spilled.stats").exists()


def test_one_pass_spills_to_the_same_bytes(world):
    d = world["d"]
    logs: list[str] = []
    whole = d / "whole.safetensors"
    convert(world["src"], whole, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],),
                                                memory_budget=10**12), log=logs.append)
    assert any(m.startswith(f"hidden states: {_mb(CALLS * world['call'])}") for m in logs)
    logs.clear()
    small = d / "small.safetensors"
    convert(world["src"], small, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],),
                                                memory_budget=int(1.5 * world["call"])),
            log=logs.append)
    assert any(f"{CALLS} of {CALLS} call(s) spilled to disk" in m for m in logs)
    assert _tensors(small) == _tensors(whole)
    assert not work_dir(small).exists()


def test_a_budget_below_one_call_is_a_usage_error(world, tmp_path):
    from h3quant.pipelines.capture import capture_statistics

    with pytest.raises(UsageError, match="cannot hold even one call's hidden state"):
        capture_statistics(world["src"], world["inputs"], tmp_path / "s.stats", predict=False,
                           memory_budget=world["call"] - 1)
    r = CliRunner().invoke(main, ["convert", str(world["src"]), str(tmp_path / "o.safetensors"),
                                  "--to", TARGET, "--calibrate-on", world["calib"],
                                  "--memory-budget", str(world["call"] - 1)])
    assert r.exit_code == 2, r.output
    assert "--memory-budget" in r.output and "cannot hold even one call's hidden state (the " \
        f"largest is {_mb(world['call'])}); give at least that" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    r = CliRunner().invoke(main, ["capture", str(world["src"]), "--inputs", world["calib"],
                                  "--out", str(tmp_path / "s.stats"), "--memory-budget", "lots"])
    assert r.exit_code == 2 and "'lots' is not a size" in r.output
    r = CliRunner().invoke(main, ["convert", str(world["src"]), str(tmp_path / "o.safetensors"),
                                  "--to", TARGET, "--memory-budget", "1GB"])
    assert r.exit_code == 2 and "--memory-budget applies to --calibrate-on" in r.output


_TERM = r"""
import os, signal, sys
from h3quant.runtime.model.model import H3Model

when = int(sys.argv[1])
real = H3Model.release_block

def release(self, index):  # SIGTERM in the middle of block `when`, after its spilled outputs
    real(self, index)
    if index == when:
        os.kill(os.getpid(), signal.SIGTERM)

H3Model.release_block = release
from h3quant.cli import main
main(sys.argv[2:])
"""


def _term(when: int, *args):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.run([sys.executable, "-c", _TERM, str(when), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=900)


def test_sigterm_removes_the_spill_files(world, tmp_path):
    from h3quant.pipelines.capture import spill_dir

    out = tmp_path / "t.stats"
    budget = str(int(1.5 * world["call"]))
    r = _term(0, "capture", world["src"], "--inputs", world["calib"], "--out", out,
              "--memory-budget", budget, "--no-predict")
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert "spilled to disk" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no spill folder
    assert not spill_dir(out).exists()
    # the one pass: killed in block 2 after its spilled outputs were written
    one = tmp_path / "one.safetensors"
    r = _term(1, "convert", world["src"], one, "--to", TARGET, "--calibrate-on",
              world["calib"], "--memory-budget", budget)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    work = work_dir(one)
    state = json.loads((work / "state.json").read_text())
    kept = {"state.json", "block_000.safetensors"} | {n for n, _ in state["hidden"]}
    assert sorted(p.name for p in work.iterdir()) == sorted(kept)
    assert {n for n, _ in state["hidden"]} == {f"hidden_001_{i:04d}.safetensors"
                                                for i in range(CALLS)}
    # the resumed run ends with the unbounded run's bytes and no work folder
    logs: list[str] = []
    convert(world["src"], one, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],),
                                              memory_budget=int(budget)), log=logs.append)
    assert any(m.startswith("resuming") for m in logs)
    ref = world["d"] / "whole.safetensors"
    if not ref.exists():
        convert(world["src"], ref, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],)))
    assert _tensors(one) == _tensors(ref)
    assert not work.exists()


def test_default_budget_is_half_the_available_memory(monkeypatch):
    from h3quant.calibration import hidden
    from h3quant.formats.container import platform

    free = platform.available_memory_bytes()
    assert free is not None and free > 0
    monkeypatch.setattr(platform, "available_memory_bytes", lambda: 10 * 10**9)
    assert hidden.default_budget() == 5 * 10**9
    monkeypatch.setattr(platform, "available_memory_bytes", lambda: None)
    assert hidden.default_budget() == 8 * 10**9


def test_available_memory_on_windows_without_windll(monkeypatch):
    """Windows simulated: no /proc, no sysconf; without ``ctypes.windll`` the platform says
    nothing (the budget falls back to 8 GB)."""
    import ctypes

    from h3quant.formats.container import platform

    monkeypatch.setattr(platform, "IS_WINDOWS", True)
    monkeypatch.delattr(os, "sysconf", raising=False)
    assert not hasattr(ctypes, "windll")
    assert platform.available_memory_bytes() is None


def test_the_store_keeps_the_calls_that_fit_plus_room_for_one(tmp_path):
    from h3quant.calibration.hidden import HiddenStates

    store = HiddenStates(tmp_path / "w", [100, 100, 300, 100], 550)  # 600 in all: over
    assert store.spilled == [2, 3]  # 100 + 100 held, + 300 read back = 500; a third: 800
    xs = [torch.full((2, 3), float(i)) for i in range(4)]
    for i, x in enumerate(xs):
        store.put(0, i, x)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "hidden_000_0002.safetensors", "hidden_000_0003.safetensors"]
    for i, x in enumerate(xs):
        assert torch.equal(store.get(0, i), x)
        store.put(1, i, x + 1)
    store.drop(0)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "hidden_001_0002.safetensors", "hidden_001_0003.safetensors"]
    (tmp_path / "w" / "hidden_001_0001.safetensors.tmp").write_bytes(b"half")
    store.close()
    assert list((tmp_path / "w").iterdir()) == []
    assert HiddenStates(tmp_path, [5, 5], None).spilled == []
    assert HiddenStates(tmp_path, [5, 5], 10).spilled == []
