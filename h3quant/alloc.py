"""Keep freed heap memory for reuse: glibc ``malloc`` settings for the encoders' chunk loops.

The encoders' chunk temporaries (a few MB each) would otherwise be unmapped and page-faulted in
again on every chunk under glibc's adaptive thresholds; ``keep_freed_memory`` fixes
``M_MMAP_THRESHOLD`` (64 MiB; 32 MiB where glibc refuses more) and ``M_TRIM_THRESHOLD`` (256 MiB).
Same bytes, far less system time (``bench/bench_w4a8.py`` prints both; figures in
docs/benchmarks.md). Process-wide, so only the ``convert`` pipeline calls it; a no-op returning
False where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20

_LOCK = threading.Lock()
_DONE: list[bool] = []


def keep_freed_memory() -> bool:
    """Apply the thresholds above once per process; True when glibc accepted them."""
    with _LOCK:
        if not _DONE:
            _DONE.append(_apply())
        return _DONE[0]


def _apply() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
