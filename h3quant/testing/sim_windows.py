"""A simulated Windows interpreter, for running h3quant's commands on a POSIX machine the way
they run on Windows (the ComfyUI portable build).

``python -m h3quant.testing.sim_windows ARGS...`` runs ``h3quant ARGS`` after making this
interpreter look like CPython on Windows *before h3quant is imported*:

* the POSIX-only modules ``fcntl``, ``resource``, ``termios``, ``grp`` cannot be imported;
* a ``msvcrt`` module offers ``locking`` (``LK_NBLCK``, ``LK_UNLCK``) with Windows' semantics
  (a byte-range lock held by the file handle; a second ``LK_NBLCK`` on a held range fails with
  ``OSError``), built on this machine's own locks;
* ``os`` lacks what Windows' ``os`` lacks (``pwrite``, ``pread``, ``fdatasync``, ``fchmod``,
  ``O_NONBLOCK``, ``O_CLOEXEC``, ``copy_file_range``, ``sched_getaffinity``, ...), and
  ``os.rename`` refuses an existing target (``FileExistsError``) as Windows' does;
* ``signal`` lacks ``SIGHUP`` (and the other POSIX-only signals) and has ``SIGBREAK``;
* ``mmap`` has no ``madvise``; ``sys.platform`` is ``"win32"``.

Third-party packages (torch, numpy, click, tqdm) and the standard-library modules that choose
their implementation at import are imported first, on the real platform: on Windows they are
their Windows builds, which this machine does not have. What runs simulated is h3quant itself.
What it cannot show: Windows' refusal to delete or replace a file another handle has open, and
path rules (drive letters, reserved names); see docs/guide.md, Windows.
"""

from __future__ import annotations

import sys

_BLOCKED = ("fcntl", "resource", "termios", "grp", "posix_ipc")
_OS_MISSING = ("pwrite", "pread", "pwritev", "preadv", "fdatasync", "fchmod", "fchown",
               "O_NONBLOCK", "O_CLOEXEC", "O_NOFOLLOW", "O_DIRECTORY", "copy_file_range",
               "sched_getaffinity", "posix_fadvise", "getuid", "geteuid", "setsid", "killpg",
               "getpgid", "sendfile", "sync")
_SIGNALS_MISSING = ("SIGHUP", "SIGQUIT", "SIGKILL", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGALRM",
                    "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGWINCH")


class _Blocker:
    """A meta-path finder refusing the POSIX-only modules, as Windows' CPython lacks them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (simulated Windows)", name=name)
        return None


def _fake_msvcrt(flock, lock_ex, lock_nb, lock_un):
    import os
    import types

    mod = types.ModuleType("msvcrt")
    mod.LK_UNLCK, mod.LK_LOCK, mod.LK_NBLCK, mod.LK_RLCK, mod.LK_NBRLCK = 0, 1, 2, 3, 4

    def locking(fd: int, mode: int, nbytes: int) -> None:
        os.fstat(fd)  # EBADF as Windows gives for a closed handle
        if mode == mod.LK_UNLCK:
            flock(fd, lock_un)
        elif mode in (mod.LK_NBLCK, mod.LK_NBRLCK):
            try:
                flock(fd, lock_ex | lock_nb)
            except OSError:
                raise PermissionError(13, "Permission denied (locked)") from None
        else:
            flock(fd, lock_ex)

    mod.locking = locking
    return mod


def simulate_windows() -> None:
    """Make this interpreter look like CPython on Windows (see the module docstring)."""
    # On the real platform first: what Windows has its own build of.
    import concurrent.futures  # noqa: F401
    import ctypes.util  # noqa: F401
    import fcntl
    import mmap
    import multiprocessing  # noqa: F401
    import os
    import shutil  # noqa: F401
    import signal
    import subprocess  # noqa: F401
    import tempfile  # noqa: F401

    import click  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import tqdm  # noqa: F401

    flock, ex, nb, un = fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN
    for name in list(sys.modules):
        if name.split(".")[0] in _BLOCKED or name.startswith("h3quant"):
            del sys.modules[name]
    sys.meta_path.insert(0, _Blocker())
    sys.modules["msvcrt"] = _fake_msvcrt(flock, ex, nb, un)
    for name in _OS_MISSING:
        if hasattr(os, name):
            delattr(os, name)
    for name in _SIGNALS_MISSING:
        if hasattr(signal, name):
            delattr(signal, name)
    signal.SIGBREAK = 21  # type: ignore[attr-defined]  # Windows' value; never raised here
    for name in [n for n in dir(mmap) if n.startswith("MADV_")] + ["madvise"]:
        if hasattr(mmap, name):
            delattr(mmap, name)
    # (mmap.mmap.madvise, a method of the C type, stays: h3quant asks for mmap.MADV_* first)
    real_rename = os.rename

    def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if os.path.lexists(dst):
            raise FileExistsError(17, "Cannot create a file when that file already exists",
                                  str(dst))
        real_rename(src, dst)

    os.rename = rename
    sys.platform = "win32"


def main(argv: list[str]) -> None:
    simulate_windows()
    from h3quant.cli import main as cli_main
    from h3quant.formats.container import platform

    assert platform.IS_WINDOWS and platform.fcntl is None and platform.msvcrt is not None
    cli_main.main(argv, prog_name="h3quant")


if __name__ == "__main__":
    main(sys.argv[1:])
