"""One measured child process for the benchmarks: an ``h3quant`` command run with a given
checkout's code, its wall time, exit status and resource usage (peak RSS) from ``os.wait4``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    seconds: float  # wall time
    exit_code: int
    peak_rss_mib: float  # ru_maxrss (KiB on Linux) in MiB
    user_s: float
    system_s: float
    stderr: str
    disk_read_bytes: int  # ru_inblock x 512: what the child read from the disk (not the cache)


def run_h3quant(tree: Path, args: list[str], *, cwd: Path, env: dict | None = None,
                check: bool = True, timeout: float | None = None) -> Child:
    """``python -m h3quant ARGS`` with checkout ``tree``'s code first on ``PYTHONPATH`` (plus
    ``env``), stdout discarded; raises ``SystemExit`` naming the tree when it fails (``check``;
    else the failed child is returned with its exit code). ``timeout``: seconds after which the
    child is killed (its exit code is then -9, its figures those it reached)."""
    cmd = [sys.executable, "-m", "h3quant", *map(str, args)]
    full_env = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty child never blocks
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.DEVNULL,
                                stderr=log)
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer is not None:
            timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        if timer is not None:
            timer.cancel()
        seconds = time.perf_counter() - t0
        log.seek(0)
        err = log.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and check:
        raise SystemExit(f"{tree}: h3quant {' '.join(map(str, args[:1]))} failed "
                         f"(exit {code}): {err.strip()[-2000:]}")
    return Child(seconds, code, usage.ru_maxrss / 1024, usage.ru_utime, usage.ru_stime, err,
                 usage.ru_inblock * 512)
