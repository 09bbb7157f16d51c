"""``h3quant.alloc``: the glibc malloc thresholds ``convert`` sets, so chunk temporaries are
reused instead of being page-faulted in again on every chunk."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from h3quant import alloc

ROOT = Path(__file__).resolve().parent.parent
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# How many bytes glibc holds in mmapped blocks (mallinfo2, glibc >= 2.33) after allocating a
# 48 MB tensor in a fresh process: glibc's adaptive mmap threshold never passes 32 MB, so without
# the settings such a block is always mapped (and unmapped, its pages given back, when freed).
_WORKLOAD = """
import ctypes, sys, torch
sys.path.insert(0, {root!r})
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if {tuned}:
    from h3quant.alloc import keep_freed_memory
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
x = torch.ones((48 << 20) // 4)  # 48 MiB of float32
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped(tuned: bool) -> int:
    code = _WORKLOAD.format(root=str(ROOT), tuned=tuned)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 33),
                    reason="glibc's thresholds, read through mallinfo2 (glibc >= 2.33)")
@pytest.mark.slow
def test_chunk_sized_blocks_come_from_the_heap():
    """Below the threshold a freed block stays in the heap for the next chunk (measured effect:
    ``bench/bench_w4a8.py``'s system seconds); without the settings it is mapped."""
    assert _mapped(False) >= 48 << 20
    assert _mapped(True) < 1 << 20


def test_applied_once_and_reported(monkeypatch):
    calls = []
    monkeypatch.setattr(alloc, "_DONE", [])
    monkeypatch.setattr(alloc, "_apply", lambda: calls.append(1) or GLIBC)
    assert alloc.keep_freed_memory() is GLIBC
    assert alloc.keep_freed_memory() is GLIBC
    assert calls == [1]


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(alloc.platform, "libc_ver", lambda: ("", ""))
    assert alloc._apply() is False
    monkeypatch.setattr(alloc.platform, "system", lambda: "Darwin")
    assert alloc._apply() is False


def test_convert_applies_it_before_encoding(tmp_path, monkeypatch):
    from h3quant.pipelines.convert import ConvertOptions, convert, run
    from helpers.h3files import small_h3, write

    seen = []
    monkeypatch.setattr(run, "keep_freed_memory", lambda: seen.append(True) or True)
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    convert(src, tmp_path / "out.safetensors", ConvertOptions(report=False))
    assert seen == [True]
