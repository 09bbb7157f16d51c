"""Read a small text file (a recipe, a saved pass, a card) with its size bounded before reading.

A FIFO, a device (``/dev/zero``), a socket or a directory is refused from ``stat`` before it is
opened, so nothing can block or grow without bound; a regular file larger than the limit is
refused from its size, and at most ``limit`` bytes are ever read (a file growing while read is
refused too).
"""

from __future__ import annotations

import os
import stat

from h3quant.errors import UsageError
from h3quant.formats.container import platform


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``UsageError`` naming the
    file and ``what`` it is otherwise."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"cannot read the {what}: {exc.strerror or exc}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory"
                if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise UsageError(f"the {what} is {kind}, not a regular file; refused before reading",
                         path=path)
    if st.st_size > limit:
        raise UsageError(f"the {what} is {st.st_size:,} bytes; the limit is {limit:,} "
                         "(h3quant.limits)", path=path)
    try:
        fd = platform.open_fd(path, os.O_RDONLY, nonblocking=True)
    except OSError as exc:
        raise UsageError(f"cannot read the {what}: {exc.strerror or exc}", path=path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped after the stat above
            raise UsageError(f"the {what} is not a regular file; refused", path=path)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UsageError(f"the {what} grew past the limit of {limit:,} bytes while "
                                 "read (h3quant.limits)", path=path)
    finally:
        os.close(fd)
    return b"".join(chunks)
