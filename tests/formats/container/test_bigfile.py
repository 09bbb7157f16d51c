"""Checkpoints larger than the machine's memory, with default options.

A private writable mapping is charged against the commit limit for its whole length, so a reader
that maps a whole checkpoint fails on a file larger than RAM plus swap (Linux's default
overcommit heuristic) or the page file (Windows). These tests meet that condition two ways:

* for real, in a child process under an address-space cap (``RLIMIT_AS``) well below the size
  of a sparse, full-width H3 file (its tensors are holes: gigabytes that take no disk);
* through ``h3quant.testing.sim_commit`` (every private writable mapping charged against a
  simulated commit limit), for every command that reads tensor data, on a real tiny H3 file.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostile_util import sparse_safetensors

resource = pytest.importorskip("resource")

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _capped(cap_bytes: int):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))
    return limit


def _h3q_capped(cap_bytes: int, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV,
                          preexec_fn=_capped(cap_bytes))


def _h3q_committed(limit: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant.testing.sim_commit", str(limit),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def full_width_sparse(path: Path, blocks: int) -> Path:
    """The full-width H3 header (hidden 5376), every tensor a hole of zeros."""
    from h3quant.h3.topology import config_for, expected_tensors

    tensors = expected_tensors(config_for("full", blocks=blocks))
    return sparse_safetensors(path, {n: (d, tuple(s)) for n, (d, s) in tensors.items()})


@pytest.mark.slow
def test_convert_full_width_file_larger_than_the_address_space_cap(tmp_path):
    src = full_width_sparse(tmp_path / "h3.safetensors", blocks=2)
    size = src.stat().st_size
    cap = 1_500_000_000
    assert size > 2 * cap  # the file is more than twice what the process may map
    out = tmp_path / "out.safetensors"
    try:
        res = _h3q_capped(cap, "convert", src, out, "--to", "int8-convrot")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "Cannot allocate memory" not in res.stderr
        check = _h3q_capped(cap, "inspect", out, "--json")
        assert check.returncode == 0, check.stderr[-2000:]
        assert '"int8_tensorwise"' in check.stdout or "int8" in check.stdout
    finally:
        out.unlink(missing_ok=True)


def test_the_cap_is_real(tmp_path):
    """The capped child cannot map what it could without the cap (else the test above proves
    nothing): a whole-file private mapping of the sparse file is refused."""
    src = full_width_sparse(tmp_path / "h3.safetensors", blocks=1)
    code = ("import mmap,sys\nf=open(sys.argv[1],'rb')\n"
            "try:\n mmap.mmap(f.fileno(),0,access=mmap.ACCESS_COPY)\nexcept OSError as e:\n"
            " print('refused', e.errno)\nelse:\n print('mapped')")
    res = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True,
                         timeout=60, preexec_fn=_capped(src.stat().st_size // 2))
    assert res.stdout.split() == ["refused", str(errno.ENOMEM)], res.stdout + res.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers.inputs import input_dims, seeded_inputs

    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("bigfile")
    src = d / "h3.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2)
    inputs = seeded_inputs(d, input_dims(src), [1, 2])
    return {"dir": d, "src": src, "inputs": inputs}


def test_sim_commit_refuses_a_whole_file_mapping(tiny):
    """The simulation refuses what the old whole-file mapping asked for at this limit."""
    src = tiny["src"]
    limit = src.stat().st_size // 2
    code = (f"from h3quant.testing.sim_commit import simulate_commit_limit as s; s({limit})\n"
            "import mmap,sys\nf=open(sys.argv[1],'rb')\n"
            "try:\n mmap.mmap(f.fileno(),0,access=mmap.ACCESS_COPY)\nexcept OSError as e:\n"
            " print('refused', e.errno)\nelse:\n print('mapped')\n"
            "m=mmap.mmap(f.fileno(),0,access=mmap.ACCESS_READ); print('read-only ok')")
    res = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.split() == ["refused", str(errno.ENOMEM), "read-only", "ok"], res.stderr


@pytest.mark.parametrize("command", ["convert", "verify", "verify-model", "plan", "capture",
                                     "compare", "validate"])
def test_every_command_under_a_commit_limit_half_the_file(tiny, tmp_path, command):
    """Default options (memory-mapped reads) on a file twice the simulated commit limit."""
    src, inputs = tiny["src"], tiny["inputs"]
    limit = src.stat().st_size // 2
    q = tiny["dir"] / "q.safetensors"
    if command != "convert" and not q.exists():
        res = _h3q_committed(limit, "convert", src, q, "--to", "int8-convrot")
        assert res.returncode == 0, res.stderr[-2000:]
    ins = [a for p in inputs for a in ("--inputs", p)]
    args = {
        "convert": ["convert", src, tmp_path / "o.safetensors", "--to", "w4a8"],
        "verify": ["verify", q, "--reference", src, "--blocks", "1"],
        "verify-model": ["verify", q, "--reference", src, "--model", "--inputs", inputs[0]],
        "plan": ["plan", src, "--target-sqnr", "20", "--out", tmp_path / "r.json"],
        "capture": ["capture", src, *ins, "--out", tmp_path / "h3.stats"],
        "compare": ["compare", q, "--reference", src, "--no-frontier"],
        "validate": ["validate", q, "--deep"],
    }[command]
    res = _h3q_committed(limit, *args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "allocate" not in res.stderr


def test_a_refused_mapping_names_the_file_and_the_remedy(tiny, tmp_path):
    """Below what one tensor needs, the refusal is one line: which file, what, what to try."""
    res = _h3q_committed(4096, "convert", tiny["src"], tmp_path / "o.safetensors",
                         "--to", "int8-convrot")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"h3quant: error: {tiny['src']}: tensor '")
    assert "error::" not in line and "--no-mmap" in line and "Cannot allocate memory" in line
    assert not (tmp_path / "o.safetensors").exists()


def test_a_full_disk_names_the_output_not_a_temporary(tmp_path):
    from h3quant.cli.os_errors import os_error_line
    from h3quant.formats.container.iofiles import CommandFiles

    files = CommandFiles("convert")
    files.read(tmp_path / "in.safetensors")
    files.write(tmp_path / "out.safetensors")
    staged = tmp_path / ".h3quant-staging-1/new/out.safetensors"
    for exc in (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staged))):
        line = os_error_line(exc)
        assert line.startswith(f"h3quant: error: {tmp_path / 'out.safetensors'}: No space left")
        assert "staging" not in line and "error::" not in line and "\n" not in line
        assert "free space" in line


def test_an_allocator_refusal_is_a_usage_error_naming_the_input(tmp_path, capsys):
    """PyTorch's allocator refusing (a RuntimeError, not MemoryError) is exit 2 with the input
    named and what to try, never 'internal error' (exit 3)."""
    from h3quant.cli.common import guard, handle_errors
    from h3quant.formats.container.iofiles import CommandFiles

    src = tmp_path / "h3.safetensors"

    @handle_errors
    def command():
        CommandFiles("verify").checkpoint(src)

        def work():
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                               " can't allocate memory: you tried to allocate 67092480 bytes. "
                               "Error code 12 (Cannot allocate memory)")
        guard("verifying", work)

    with pytest.raises(SystemExit) as ex:
        command()
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"h3quant: error: out of memory while reading {src} (")
    assert "internal error" not in err and "--no-mmap" in err and len(err.splitlines()) == 1
