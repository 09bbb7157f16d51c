"""Shared by the reliability tests: run ``h3quant`` in a child under a memory cap and a timeout,
and the tiny synthetic files they feed it (made here, nothing downloaded)."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "H3QUANT_DEBUG": ""}


def memory_cap(wanted: int = 4 << 30) -> int:
    """``wanted`` bytes of address space, never above this process's own hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    caps = [c for c in (hard, soft) if c != resource.RLIM_INFINITY]
    return min([wanted] + caps)


def _limit():
    cap = memory_cap()
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def h3q(*args, timeout: float = 120, stdin=None) -> subprocess.CompletedProcess:
    """``python -m h3quant ARGS`` under ``memory_cap()`` and ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT,
                          preexec_fn=_limit, stdin=stdin)


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tiny_base(path: Path, blocks: int = 2, seed: int = 11) -> Path:
    from h3quant.synth import synth_checkpoint

    synth_checkpoint(path, preset="tiny", blocks=blocks, seed=seed, workers=1)
    return path


def tiny_lora(path: Path, style: str = "comfyui", blocks: int = 1, rank: int = 2) -> Path:
    from h3quant.h3.topology import config_for
    from h3quant.synth.lora import write_lora

    write_lora(path, config_for("tiny", blocks=blocks), style, rank=rank, scale=0.01, seed=1,
               overwrite=True)
    return path


def sparse_safetensors(path: Path, entries: dict, data: dict | None = None) -> Path:
    """A safetensors file whose header lists ``entries`` (name -> (dtype, shape)); the tensors
    in ``data`` (name -> bytes) are written, every other one is a hole of zeros, so a header can
    name gigabytes that take no disk."""
    import json
    import math

    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1,
             "U8": 1, "I32": 4, "I64": 8}
    header, off = {}, 0
    for name, (dtype, shape) in entries.items():
        n = math.prod(shape) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + off)
        for name, blob in (data or {}).items():
            fh.seek(8 + len(raw) + header[name]["data_offsets"][0])
            fh.write(blob)
    return path


def peak_rss_mb(res) -> float:
    """Peak resident memory of the children this process has waited for, in MB (Linux kB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# The child reports its own peak RSS (VmHWM of its own address space) when it exits: ru_maxrss
# from wait4 also counts the forked copy of this process from before exec, so in a large pytest
# parent every child would look as large as the parent.
_HWM_CHILD = """
import atexit, os, runpy, sys
def _hwm():
    try:
        with open('/proc/self/status') as fh:
            kib = next(line.split()[1] for line in fh if line.startswith('VmHWM:'))
        with open(os.environ['H3Q_HWM_FILE'], 'w') as out:
            out.write(kib)
    except (OSError, StopIteration):
        pass
atexit.register(_hwm)
sys.argv = ['h3quant'] + sys.argv[1:]
runpy.run_module('h3quant', run_name='__main__', alter_sys=True)
"""


def h3q_measured(*args, timeout: float = 120) -> tuple[int, str, float, float]:
    """``python -m h3quant ARGS`` under ``memory_cap()``: (exit status, stdout + stderr, the
    child's CPU seconds (user + system, from ``os.wait4``) and its own peak RSS in MB). CPU
    time, not wall time: a loaded machine stretches the wall clock of any run, while work done
    on a hostile header shows as CPU time; a child still running after ``timeout`` wall seconds
    is killed (its exit status then says so). The peak is the child's own address space's
    (``VmHWM``, written by the child as it exits; ``ru_maxrss`` where that is unavailable)."""
    import tempfile
    import time

    with tempfile.TemporaryFile() as log, tempfile.TemporaryDirectory() as d:
        hwm = Path(d) / "hwm"
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", _HWM_CHILD, *map(str, args)],
                                env={**ENV, "H3Q_HWM_FILE": str(hwm)}, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_limit)
        while True:  # wait4 (not Popen.wait) reaps the child: its usage comes with it
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                proc.kill()
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        secs = usage.ru_utime + usage.ru_stime
        log.seek(0)
        text = log.read().decode(errors="replace")
        peak = int(hwm.read_text()) / 1024 if hwm.exists() else usage.ru_maxrss / 1024
    return proc.returncode, text, secs, peak
