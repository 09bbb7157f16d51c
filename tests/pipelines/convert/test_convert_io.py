"""convert's I/O levers: kernel-side copies of byte-for-byte tensors, with a fallback through
memory that gives the same bytes (also when the kernel refuses part way through)."""

from __future__ import annotations

import errno
import os

import pytest

from h3quant.pipelines.convert import ConvertOptions, convert, io
from h3quant.pipelines.convert.io import OffsetWriter
from helpers.h3files import sha


def _convert(src, dst, **kw):
    convert(src, dst, ConvertOptions(report=False, **kw))
    return sha(dst)


@pytest.fixture
def kernel_copy(monkeypatch):
    monkeypatch.setattr(io, "_kernel_copy", [True])


def test_copied_tensors_go_through_the_kernel_and_match_the_memory_path(src, tmp_path, monkeypatch,
                                                                       kernel_copy):
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range here")
    calls = []
    real = OffsetWriter.copy_range
    monkeypatch.setattr(OffsetWriter, "copy_range",
                        lambda self, *a: calls.append(a[0]) or real(self, *a))
    kernel = _convert(src, tmp_path / "k.safetensors")
    assert calls and "adaln_t_table" in calls  # the byte-for-byte tensors took the kernel path
    monkeypatch.setattr(io, "_kernel_copy", [False])
    calls.clear()
    memory = _convert(src, tmp_path / "m.safetensors")
    assert not calls
    assert kernel == memory


@pytest.mark.slow
@pytest.mark.parametrize("err", [errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_a_kernel_that_refuses_part_way_falls_back_with_the_same_bytes(src, tmp_path, monkeypatch,
                                                                      kernel_copy, err):
    reference = _convert(src, tmp_path / "ref.safetensors", workers=1)
    budget = [3]

    def flaky(src_fd, dst_fd, count, offset_src, offset_dst):
        if budget[0] == 0:
            raise OSError(err, os.strerror(err))
        budget[0] -= 1
        n = max(1, count // 3)  # partial copies: the fallback resumes mid-tensor
        data = os.pread(src_fd, n, offset_src)
        return os.pwrite(dst_fd, data, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", flaky, raising=False)
    assert _convert(src, tmp_path / "flaky.safetensors", workers=1) == reference
    assert io._kernel_copy == [False]


def test_a_real_io_error_in_the_kernel_copy_fails_the_run(src, tmp_path, monkeypatch, kernel_copy):
    def broken(*a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "copy_file_range", broken, raising=False)
    with pytest.raises(Exception) as info:
        convert(src, tmp_path / "out.safetensors", ConvertOptions(report=False))
    assert "I/O error" in str(info.value) or isinstance(info.value, OSError)
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "in.safetensors"]


# ------------------------------------------------- the copies start before torch is loaded
_TIMELINE_CHILD = r"""
import json, os, sys, threading

seen = {}

def hook(event, args):
    if event == "import" and args[0] == "torch" and "torch" not in seen:
        dst = sys.argv[2]
        staged = [os.path.join(r, f) for r, _, fs in os.walk(os.path.dirname(dst)) for f in fs
                  if ".h3quant-staging-" in r and f.endswith(".tmp") and f != ".lock"]
        seen["torch"] = {"threads": sorted(t.name for t in threading.enumerate()),
                         "staged": [os.path.getsize(p) for p in staged]}

sys.addaudithook(hook)
from h3quant.cli import main

try:
    main(["convert", sys.argv[1], sys.argv[2], "-q"])
except SystemExit as exc:
    seen["exit"] = exc.code
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_copies_start_before_torch_is_imported(src, tmp_path):
    """The CLI's convert opens its output and starts the byte-for-byte copies first, and only
    then loads torch (1-2 s on a small machine) for the layers, while the copies run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    dst = tmp_path / "out" / "o.safetensors"
    dst.parent.mkdir()
    res = subprocess.run([sys.executable, "-c", _TIMELINE_CHILD, str(src), str(dst)],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen.get("exit") == 0, seen
    assert "torch" in seen, "convert never imported torch"  # it has layers to encode
    assert any(t.startswith("h3quant-copy") for t in seen["torch"]["threads"]), seen
    # the output's temp file exists at its full planned size (header written) already
    assert len(seen["torch"]["staged"]) == 1 and seen["torch"]["staged"][0] > 0, seen
    assert dst.stat().st_size == seen["torch"]["staged"][0]


def test_the_planning_and_copying_modules_do_not_import_torch():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = ("import sys\n"
            "import h3quant.cli.convert_cmd, h3quant.cli.render, h3quant.pipelines.convert\n"
            "import h3quant.pipelines.convert.stream, h3quant.pipelines.convert.io\n"
            "from h3quant.formats import registry\n"
            "for t in registry.targets().values():\n"
            "    for layout in registry.layouts_of(registry.target_codec(t.name)):\n"
            "        registry.with_layout(registry.target_codec(t.name), layout).spec.planning.marker(t, 256)\n"
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=root, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


class _FailingImport:
    """Stands in for ``convert.run`` (the module that loads torch) and fails on first use."""

    def __init__(self, exc):
        self.exc = exc

    def __getattr__(self, name):
        raise self.exc


@pytest.mark.parametrize("exc", [ImportError("torch is broken"), KeyboardInterrupt()])
def test_a_failure_while_torch_loads_leaves_nothing_behind(src, tmp_path, monkeypatch, exc):
    """The copies are already running when torch loads: an import error or Ctrl-C there stops
    them and removes every temporary, like any other failure."""
    import sys
    import threading

    monkeypatch.setitem(sys.modules, "h3quant.pipelines.convert.run", _FailingImport(exc))
    with pytest.raises(type(exc)):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(report=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]
    assert not [t for t in threading.enumerate() if t.name.startswith("h3quant-copy")]


# ------------------------------------------------------- no interpreter teardown after convert
_EXIT_CHILD = r"""
import atexit, sys
atexit.register(lambda: sys.stderr.write("TEARDOWN\n"))
from h3quant.cli import run
run(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_finished_convert_process_exits_without_the_interpreter_teardown(src, tmp_path):
    """After a successful convert the process ends at once (stdout and stderr flushed, the
    output in place); failures and other commands exit the normal way."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]

    def child(*args):
        return subprocess.run([sys.executable, "-c", _EXIT_CHILD, *map(str, args)],
                              capture_output=True, text=True, timeout=300, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})

    dst = tmp_path / "o.safetensors"
    res = child("convert", src, dst, "--json")
    assert res.returncode == 0, res.stderr
    assert "TEARDOWN" not in res.stderr
    assert json.loads(res.stdout)["output_bytes"] == dst.stat().st_size  # stdout complete
    assert "wrote" in res.stderr  # the summary line reached stderr
    again = child("convert", src, dst)  # exists, no --overwrite: exit 2, the normal way
    assert again.returncode == 2 and "TEARDOWN" in again.stderr, again.stderr
    other = child("inspect", dst)
    assert other.returncode == 0 and "TEARDOWN" in other.stderr


# ------------------------------------------- W4A8 outputs written while the next layer encodes
def test_w4a8_outputs_are_written_behind_with_the_same_bytes(src, tmp_path, monkeypatch):
    """A W4A8 layer's outputs go to the writer thread (the next layer encodes meanwhile); the
    file equals one written in line."""
    import threading

    from h3quant.pipelines.convert.io import Sinks

    writers: set[str] = set()
    real = Sinks.write_tensor

    def spy(self, name, tensor, start=0):
        if name.endswith(".weight_s_channel"):
            writers.add(threading.current_thread().name)
        return real(self, name, tensor, start)

    monkeypatch.setattr(Sinks, "write_tensor", spy)
    behind = _convert(src, tmp_path / "behind.safetensors", target="w4a8")
    assert writers and all(t.startswith("h3quant-write") for t in writers), writers
    monkeypatch.setattr(Sinks, "write_behind",
                        lambda self, tensors: [self.write_tensor(n, t) for n, t in tensors.items()])
    writers.clear()
    inline = _convert(src, tmp_path / "inline.safetensors", target="w4a8")
    assert writers == {"MainThread"}
    assert behind == inline


@pytest.mark.parametrize("layer", ["blocks.0.attn.qkv_proj", "blocks.0.mlp.fc2"])  # first, last
def test_a_failed_write_behind_fails_the_run_and_leaves_nothing(src, tmp_path, monkeypatch, layer):
    real = OffsetWriter.write

    def full(self, name, start, data):
        if name == f"{layer}.weight":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, start, data)

    monkeypatch.setattr(OffsetWriter, "write", full)
    with pytest.raises(OSError, match="No space"):
        convert(src, tmp_path / "out.safetensors", ConvertOptions(target="w4a8", report=False))
    assert not [p for p in tmp_path.iterdir() if p.name != "in.safetensors"]


def test_one_batch_in_flight_at_most():
    """``write_behind`` returns at once, but the next call waits for the batch before it (one
    finished layer held in memory, not a queue of them); ``wait_behind`` raises its error."""
    import threading
    import time

    from h3quant.pipelines.convert.io import Sinks

    gate, order = threading.Event(), []

    class Slow:
        def write_tensor(self, name, tensor, start=0):
            if name == "a":
                gate.wait(10)
            if name == "c":
                raise OSError(errno.EIO, "I/O error")
            order.append(name)

    sinks = Sinks({"a": Slow(), "b": Slow(), "c": Slow()})
    sinks.write_behind({"a": None})  # returns while "a" is still being written
    second = threading.Thread(target=sinks.write_behind, args=({"b": None},))
    second.start()
    time.sleep(0.2)
    assert second.is_alive() and order == []  # waits for "a"
    gate.set()
    second.join(10)
    sinks.wait_behind()
    assert order == ["a", "b"]
    sinks.write_behind({"c": None})
    with pytest.raises(OSError, match="I/O error"):
        sinks.wait_behind()
    sinks.close()
