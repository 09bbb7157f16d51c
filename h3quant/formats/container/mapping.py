"""Memory-mapped windows of an input file: one private mapping per read, never the whole file.

Each read maps just the bytes it needs, widened down to ``mmap.ALLOCATIONGRANULARITY`` (the
offset rule on both POSIX and Windows), as a private copy-on-write mapping: ``torch.frombuffer``
gets a writable buffer without a copy, and no write can ever reach the file. Such a mapping is
charged against the commit limit for its length, so the charge is one tensor (or one row chunk)
at a time, not the checkpoint: a 40 GB file reads on a machine with 16 GB of memory.

A window is unmapped when the last tensor viewing it is gone. The live ones are tracked (weak
references) so that ``advise`` can drop a range's pages while tensors still view it.
"""

from __future__ import annotations

import errno
import mmap
import threading
import weakref
from pathlib import Path

from h3quant.errors import ContainerError
from h3quant.sizes import size_text

_PRUNE_EVERY = 64  # live-window list entries between sweeps of the dead ones


class MappedWindows:
    """The live mapped windows of one open file (thread-safe)."""

    def __init__(self, path: Path):
        self.path = path
        self._live: list[tuple[weakref.ref, int, int]] = []  # (mapping, file begin, file end)
        self._lock = threading.Lock()

    def view(self, fd: int, offset: int, length: int, tensor: str | None = None) -> memoryview:
        """``length`` bytes of the file at ``offset``, through a new private mapping."""
        lo = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(fd, offset + length - lo, access=mmap.ACCESS_COPY, offset=lo)
        except (OSError, OverflowError, ValueError) as exc:
            raise ContainerError(map_failure(exc, offset + length - lo), path=self.path,
                                 tensor=tensor, code="C112") from None
        with self._lock:
            if len(self._live) >= _PRUNE_EVERY:
                self._live = [w for w in self._live if w[0]() is not None]
            self._live.append((weakref.ref(mm), lo, lo + len(mm)))
        return memoryview(mm)[offset - lo: offset - lo + length]

    def advise(self, advice_name: str, begin: int, length: int) -> None:
        """``madvise`` the pages of file range ``[begin, begin + length)`` in every live window
        that maps them (advice only: a platform without it, or a failed call, does nothing)."""
        advice = getattr(mmap, advice_name, None)
        if advice is None or length <= 0:
            return
        end = begin + length
        with self._lock:
            live = [(w(), lo, hi) for w, lo, hi in self._live]
        for mm, lo, hi in live:
            if mm is None or hi <= begin or lo >= end:
                continue
            a = max(begin, lo) - lo
            a -= a % mmap.PAGESIZE
            b = min(end, hi) - lo
            try:
                mm.madvise(advice, a, b - a)
            except (OSError, ValueError):
                pass  # advice only (or the window was closed meanwhile)

    def close(self) -> None:
        """Unmap every window no tensor still views (the others go with their tensors)."""
        with self._lock:
            live, self._live = self._live, []
        for w, _, _ in live:
            mm = w()
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # tensors still view it; it is unmapped when they are gone


def map_failure(exc: BaseException, nbytes: int) -> str:
    """One line for a mapping the operating system refused, with what to try."""
    reason = getattr(exc, "strerror", None) or str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EAGAIN) or \
            getattr(exc, "winerror", None) in (8, 1455):  # not enough memory / page file
        return (f"cannot map {size_text(nbytes)} of this file ({reason}): not enough memory "
                "or address space; close other programs, or rerun with --no-mmap")
    return f"cannot map {size_text(nbytes)} of this file ({reason}); rerun with --no-mmap"
