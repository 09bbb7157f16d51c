"""One line for an operating-system failure: which file, what happened, what to try.

An ``OSError`` without a file name (a full disk met by a write, an allocation refused) and an
allocation failure (``MemoryError``, or PyTorch's allocator refusing on any device) are about
the running command's own files: its outputs for a full disk, its inputs for memory.
"""

from __future__ import annotations

import errno
import re

from h3quant.errors import escape_controls
from h3quant.formats.container import iofiles

_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_NOMEM = {errno.ENOMEM}
# PyTorch's allocators, by device: "DefaultCPUAllocator: can't allocate memory", "CUDA out of
# memory", "MPS backend out of memory", "NPU out of memory"
_ALLOC_FAILED = re.compile(r"can't allocate memory|out of memory|Cannot allocate memory",
                           re.IGNORECASE)
MEMORY_ADVICE = ("close other programs, or use a machine or device with more memory; an input "
                 "read with --no-mmap needs no address space for its mapping")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure: ``MemoryError``, or PyTorch's ``RuntimeError`` from an
    allocator (``torch.OutOfMemoryError`` is one)."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_ALLOC_FAILED.search(str(exc)))


def _names(outputs: bool) -> str:
    files = iofiles.current()
    if files is None:
        return ""
    uses = files.outputs if outputs else files.inputs
    paths = [escape_controls(str(u.path)) for u in uses if "shard" not in u.what][:2]
    return ", ".join(paths)


def memory_line(exc: BaseException) -> str:
    """``h3quant: error: ...`` for an allocation failure."""
    detail = escape_controls(str(exc)).strip().splitlines()[0][:200] if str(exc) else ""
    where = _names(outputs=False)
    about = f" while reading {where}" if where else ""
    why = f" ({detail})" if detail else ""
    return f"h3quant: error: out of memory{about}{why}; {MEMORY_ADVICE}"


def os_error_line(exc: OSError) -> str:
    """``h3quant: error: ...`` for an ``OSError``, naming the file it is about."""
    reason = escape_controls(exc.strerror or str(exc))
    name = getattr(exc, "filename", None)
    if exc.errno in _FULL:
        # the command's own outputs first: the file written is a temporary beside one of them
        target = _names(outputs=True) or (escape_controls(str(name)) if name else "")
        about = f"{target}: " if target else ""
        return (f"h3quant: error: {about}{reason} (the disk is full; nothing was written): free "
                "space on that disk, or write the output to another one")
    if exc.errno in _NOMEM:
        source = escape_controls(str(name)) if name else _names(outputs=False)
        about = f"{source}: " if source else ""
        return f"h3quant: error: {about}{reason}; {MEMORY_ADVICE}"
    about = f"{escape_controls(str(name))}: " if name else ""
    return f"h3quant: error: {about}{reason}"
