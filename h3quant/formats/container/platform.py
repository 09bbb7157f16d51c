"""Every operating-system call that differs between POSIX and Windows, in one place.

The rest of h3quant calls these and never ``fcntl``, ``msvcrt``, ``resource``, ``os.pwrite``,
``os.fdatasync``, ``os.fchmod``, ``os.open`` or POSIX-only signals directly
(``tests/formats/container/test_windows.py`` checks it), so the package imports and runs on Windows (the ComfyUI
portable build) with the same rules:

=====================  =============================================  ==========================
what                   POSIX                                          Windows
=====================  =============================================  ==========================
signals that unwind    SIGTERM, SIGHUP                                SIGTERM, SIGBREAK
exclusive lock         ``fcntl.flock`` (non-blocking)                 ``msvcrt.locking`` (1 byte)
positioned write       ``os.pwrite`` (thread-safe)                    seek + write under a lock
no-clobber rename      ``renameat2(RENAME_NOREPLACE)``, else          ``os.rename`` (refuses an
                       ``link`` / ``mkdir`` then rename               existing target itself)
raw file descriptors   ``O_CLOEXEC``, ``O_NONBLOCK`` on inputs        ``O_BINARY`` (no newline
                                                                      translation)
peak memory            ``resource.getrusage``                         not measured (None)
available memory       ``/proc/meminfo``, else ``sysconf`` free pages  ``GlobalMemoryStatusEx``
read-ahead advice      ``posix_fadvise(WILLNEED)``                    none (the mapping faults)
=====================  =============================================  ==========================

Which branch runs is decided by what the interpreter offers (the module imports, the ``os``
function exists), so a platform is simulated by removing them (``tests/formats/container/test_windows.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import sys
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # POSIX
    msvcrt = None  # type: ignore[assignment]
try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

IS_WINDOWS = sys.platform == "win32"

#: Signals that end a command the way Ctrl-C does (those this platform has).
TERMINATION_SIGNALS: tuple[int, ...] = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, n))
#: Signals a critical section holds back: the above and SIGINT.
DEFERRED_SIGNALS: tuple[int, ...] = TERMINATION_SIGNALS + (signal.SIGINT,)

_O_BINARY = getattr(os, "O_BINARY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_fd(path, flags: int, mode: int = 0o777, *, nonblocking: bool = False) -> int:
    """``os.open`` in binary mode, not inherited by children; ``nonblocking`` opens without
    waiting where the platform can (a FIFO's open would otherwise block) and then switches the
    descriptor back to blocking reads."""
    fd = os.open(path, flags | _O_BINARY | _O_CLOEXEC | (_O_NONBLOCK if nonblocking else 0), mode)
    if nonblocking and _O_NONBLOCK:
        try:
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
    return fd


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; False when another
    process holds it. The lock lasts until ``fd`` is closed (or the process ends)."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        elif msvcrt is not None:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


_SEEK_WRITE = threading.Lock()


def pwrite(fd: int, data, offset: int) -> int:
    """Write ``data`` at byte ``offset`` of ``fd``; returns the bytes written (maybe fewer).
    Safe from several threads at once on either platform."""
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    with _SEEK_WRITE:  # seek + write is one step for every thread of this process
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


def datasync(fd: int) -> None:
    """Push ``fd``'s data to the disk (``fdatasync`` where it exists, else ``fsync``)."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def set_mode(fd: int, path, mode: int) -> None:
    """Permission bits of an open file (by descriptor where the platform can)."""
    if hasattr(os, "fchmod"):
        os.fchmod(fd, mode)
    else:
        os.chmod(path, mode)


def read_ahead(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a byte range of ``fd`` into the page cache
    (``posix_fadvise(WILLNEED)``; advice only, and nothing where the platform lacks it)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or length <= 0:
        return
    try:
        advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def max_rss_bytes() -> int | None:
    """This process's peak resident memory, or None where the platform does not say."""
    if resource is None:
        return None
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # bytes on macOS, KiB on Linux


def available_memory_bytes() -> int | None:
    """The memory the machine has free for a new allocation now (Linux: ``MemAvailable``;
    Windows: ``GlobalMemoryStatusEx``; other POSIX: free pages), or None where it does not say."""
    if IS_WINDOWS:
        windll = getattr(ctypes, "windll", None)
        if windll is None:
            return None

        class _Status(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong),
                        ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong),
                        ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

        status = _Status()
        status.dwLength = ctypes.sizeof(_Status)
        if not windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return None
        return int(status.ullAvailPhys)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    sysconf = getattr(os, "sysconf", None)
    if sysconf is None:
        return None
    try:
        return int(sysconf("SC_AVPHYS_PAGES")) * int(sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return None


# --------------------------------------------------------------------------------------------
# no-clobber rename
# --------------------------------------------------------------------------------------------
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc = None


def _renameat2():
    global _libc
    if IS_WINDOWS:
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, "renameat2", None) if _libc else None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists, checked atomically."""
    if IS_WINDOWS:
        os.rename(src, dst)  # Windows' rename never replaces: FileExistsError if taken
        return
    fn = _renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    # Fallback for file systems without RENAME_NOREPLACE: claim the name atomically first.
    if src.is_dir() and not src.is_symlink():
        os.mkdir(dst)  # FileExistsError if taken; then rename onto our own empty directory
        try:
            os.rename(src, dst)
        except BaseException:
            os.rmdir(dst)
            raise
    else:
        os.link(src, dst)  # FileExistsError if taken
        os.unlink(src)
