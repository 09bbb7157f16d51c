"""Keep freed heap memory for reuse: glibc ``malloc`` settings for the encoders' chunk loops.

The encoders work in row chunks whose temporaries are a few MB each (the W4A8 candidate levels
of a 512K-value chunk: 10 MB). glibc serves such blocks with ``mmap`` until its adaptive
threshold has grown past them, returning them to the kernel on ``free``, and even then trims
the heap whenever more than twice that threshold lies free at its top; every reuse then
page-faults the memory in again, zero-filled. Measured on the 2-core development VM, a fresh
process encoding one W4A8 layer spent about as much CPU in the kernel as in the encoder (about
24 ns of system time per weight against 22 of user time); with the settings below the system
time is under 1 ns per weight and the bytes are the same (``bench/bench_w4a8.py`` prints both).

``keep_freed_memory`` fixes the two thresholds instead of letting glibc adapt them:

- ``M_MMAP_THRESHOLD`` 64 MiB (glibc's adaptive value never passes 32 MiB; 32 MiB where a
  glibc refuses more): blocks below it come from the heap, larger ones (whole-layer tensors)
  are still mapped and unmapped, so the memory they held goes back to the system when freed;
- ``M_TRIM_THRESHOLD`` 256 MiB (adaptive: at most 64 MiB): freed heap memory up to that much
  is kept for the next chunk instead of being returned and faulted in again.

The peak resident size is that of the working set either way. Process-wide, so it is called by
the ``convert`` pipeline (the ``h3quant`` process), never by the library's tensor functions. A
no-op returning False where the C library is not glibc (macOS, musl, Windows).
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
