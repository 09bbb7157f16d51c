"""The one atomic-output helper: every file or directory h3quant writes goes through ``Outputs``.

Rules (what a user can rely on):

* An output is never an input (same path, a link to it, or the same inode), never another output
  of the same command, and never anything but a regular file (or, for sharded output, a
  directory holding h3quant's own output and nothing else, recognised by its manifest
  ``.h3quant-output.json``).
* Each output is written into a staging directory beside it (``.h3quant-staging-*.tmp``, held
  with ``flock`` while the command runs) and moved into place only when every output of the
  command is complete: all of them appear, or none does.
* Without ``overwrite`` the final move refuses to replace anything (``renameat2`` with
  ``RENAME_NOREPLACE``, or ``link``/``mkdir`` where that is missing), so the check is atomic:
  of two runs racing for one output, one wins and the other fails cleanly.
* A staging directory whose lock is free belongs to a run that was killed; the next command
  writing beside it removes it and says so.
* SIGTERM and SIGHUP (``terminate_on_signals``) unwind like SIGINT, so staging is removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from h3quant.errors import OutputError

STAGING_PREFIX = ".h3quant-staging-"
STAGING_SUFFIX = ".tmp"
_UNLOCKED_SUFFIX = ".new"  # a staging directory before its lock is held (never cleaned as stale)
LOCK_NAME = ".lock"
MANIFEST_NAME = ".h3quant-output.json"
MANIFEST_KIND = "h3quant-output"


# --------------------------------------------------------------------------------------------
# no-clobber rename
# --------------------------------------------------------------------------------------------
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc = None


def _renameat2():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, "renameat2", None) if _libc else None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists, checked atomically."""
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


# --------------------------------------------------------------------------------------------
# path checks
# --------------------------------------------------------------------------------------------
def _same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_manifest(directory: Path) -> list[str] | None:
    """The file names an h3quant output directory's manifest lists, or None if it has none."""
    try:
        raw = (directory / MANIFEST_NAME).read_bytes()
        if len(raw) > 1 << 20:
            return None
        obj = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    files = obj.get("files") if isinstance(obj, dict) and obj.get("kind") == MANIFEST_KIND else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return files


def is_own_output_dir(directory: Path) -> bool:
    """True when ``directory`` holds exactly what its h3quant manifest lists (or nothing)."""
    try:
        present = set(os.listdir(directory))
    except OSError:
        return False
    if not present:
        return True
    listed = read_manifest(directory)
    if listed is None:
        return False
    if present != set(listed) | {MANIFEST_NAME}:
        return False
    return all(stat.S_ISREG(os.lstat(directory / f).st_mode) for f in present)


def write_manifest(directory: Path) -> None:
    """Record the files of an output directory (written last, before the directory moves)."""
    files = sorted(f for f in os.listdir(directory) if f != MANIFEST_NAME)
    body = {"kind": MANIFEST_KIND, "files": files}
    with open(directory / MANIFEST_NAME, "w", encoding="utf-8") as fh:
        json.dump(body, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def check_output(path: Path, *, directory: bool, overwrite: bool,
                 inputs: Iterable[Path] = (), what: str = "output") -> None:
    """Refuse an output path that is an input, a non-regular file, a foreign directory or an
    existing file without ``overwrite``. Raises ``OutputError`` naming the file."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"the {what}'s directory does not exist", path=path)
    if path.name in ("", ".", ".."):
        raise OutputError(f"the {what} must name a file", path=path)
    st = _stat(path)
    for inp in inputs:
        inp = Path(inp)
        ist = _stat(inp)
        if os.path.abspath(inp) == os.path.abspath(path) or (
                st is not None and ist is not None and _same_inode(st, ist)):
            raise OutputError(f"the {what} is the input {inp} (same file); choose another path",
                              path=path)
        if directory and ist is not None:
            try:
                Path(inp).resolve().relative_to(path.resolve())
                raise OutputError(f"the {what} directory contains the input {inp}; "
                                  "choose another path", path=path)
            except ValueError:
                pass
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(lst.st_mode):
        raise OutputError(f"the {what} is a symbolic link; name the real path", path=path)
    if stat.S_ISDIR(lst.st_mode):
        if not directory:
            raise OutputError(f"the {what} is a directory", path=path)
        if not is_own_output_dir(path):
            raise OutputError(f"the {what} directory holds files h3quant did not write; "
                              "choose a new or empty directory", path=path)
        if not overwrite and os.listdir(path):
            raise OutputError(f"the {what} exists; pass --overwrite to replace it", path=path)
        return
    if not stat.S_ISREG(lst.st_mode):
        raise OutputError(f"the {what} exists and is not a regular file", path=path)
    if directory:
        raise OutputError(f"the {what} must be a directory (sharded output) but is a file",
                          path=path)
    if not overwrite:
        raise OutputError(f"the {what} exists; pass --overwrite to replace it", path=path)


def check_outputs_distinct(paths: Iterable[Path]) -> None:
    seen: dict[str, Path] = {}
    for p in paths:
        key = os.path.normcase(os.path.abspath(Path(p).parent.resolve() / Path(p).name))
        if key in seen:
            raise OutputError(f"two outputs name the same file ({seen[key]} and {p})", path=p)
        seen[key] = Path(p)
    stats = {}
    for p in paths:
        st = _stat(Path(p))
        if st is not None:
            k = (st.st_dev, st.st_ino)
            if k in stats:
                raise OutputError(f"two outputs are the same file ({stats[k]} and {p})", path=p)
            stats[k] = p


# --------------------------------------------------------------------------------------------
# staging and stale temporaries
# --------------------------------------------------------------------------------------------
def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_stale(directory: Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Remove staging directories beside outputs left by killed runs (their lock is free)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(STAGING_PREFIX) and name.endswith(STAGING_SUFFIX)):
            continue
        stage = Path(directory) / name
        if stage.is_symlink() or not stage.is_dir():
            continue
        fd = _try_lock(stage / LOCK_NAME)
        if fd is None:
            continue  # a live run holds it
        try:
            shutil.rmtree(stage, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(stage)
        if log:
            log(f"h3quant: removed stale temporary {stage} (left by an interrupted run)")
    return removed


class _Stage:
    """One locked staging directory in one parent directory."""

    def __init__(self, parent: Path):
        # Made and locked under a name clean_stale() does not match, then renamed: another run's
        # clean_stale() must never see a live staging directory before its lock is held.
        born = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-",
                                     suffix=_UNLOCKED_SUFFIX, dir=parent))
        self.lock_fd = _try_lock(born / LOCK_NAME)
        self.path = born.with_name(born.name[:-len(_UNLOCKED_SUFFIX)] + STAGING_SUFFIX)
        os.rename(born, self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


@dataclass
class _Item:
    target: Path
    staged: Path
    directory: bool
    what: str
    backup: Path | None = None
    placed: bool = False


class Outputs:
    """The outputs of one command, staged and committed together.

    ::

        with Outputs(inputs=[src], overwrite=False, log=log) as outs:
            tmp = outs.add(dst)                 # checked now; write to ``tmp``
            rep = outs.add(report, what="report")
            ...write both...
        # both are in place here; after an exception neither is, and nothing is left behind

    A directory output (``directory=True``) is created empty at the staged path; its manifest
    is written at commit.
    """

    def __init__(self, *, inputs: Iterable[Path] = (), overwrite: bool = False,
                 log: Callable[[str], None] | None = None):
        self.inputs = [Path(p) for p in inputs]
        self.overwrite = overwrite
        self.log = log
        self._items: list[_Item] = []
        self._stages: dict[Path, _Stage] = {}

    def check(self, target: str | os.PathLike, *, directory: bool = False,
              what: str = "output") -> Path:
        target = Path(target)
        check_output(target, directory=directory, overwrite=self.overwrite, inputs=self.inputs,
                     what=what)
        check_outputs_distinct([i.target for i in self._items] + [target])
        return target

    def add(self, target: str | os.PathLike, *, directory: bool = False,
            what: str = "output") -> Path:
        """Check ``target`` and return the staged path to write it to."""
        target = self.check(target, directory=directory, what=what)
        parent = target.parent.resolve()
        stage = self._stages.get(parent)
        if stage is None:
            clean_stale(parent, self.log)
            try:
                stage = self._stages[parent] = _Stage(parent)
            except OSError as exc:
                raise OutputError(f"cannot create a temporary beside the {what}: "
                                  f"{exc.strerror or exc}", path=target) from None
        staged = stage.path / target.name
        if directory:
            os.mkdir(staged, default_mode(directory=True))
        self._items.append(_Item(target, staged, directory, what))
        return staged

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def abort(self) -> None:
        for stage in self._stages.values():
            stage.remove()
        self._stages.clear()

    def commit(self) -> None:
        """Move every staged output into place, or none (earlier ones are rolled back)."""
        try:
            for item in self._items:
                if item.directory:
                    write_manifest(item.staged)
                    fsync_dir(item.staged)
                elif item.staged.exists():
                    os.chmod(item.staged, default_mode())
                else:
                    raise OutputError(f"the {item.what} was never written", path=item.target)
            for item in self._items:
                self._place(item)
            for parent in {i.target.parent for i in self._items}:
                fsync_dir(parent)
        except BaseException:
            self._rollback()
            self.abort()
            raise
        self.abort()  # removes the staging directories (and any replaced old output)

    def _place(self, item: _Item) -> None:
        # re-check at the last moment: the path may have changed while we worked
        if not self.overwrite and os.path.lexists(item.target) and not (
                item.directory and os.path.isdir(item.target) and not os.listdir(item.target)):
            raise OutputError(f"the {item.what} appeared while this run was writing (another "
                              "run?); nothing was written; pass --overwrite to replace it",
                              path=item.target)
        check_output(item.target, directory=item.directory, overwrite=self.overwrite,
                     inputs=self.inputs, what=item.what)
        stage = item.staged.parent
        if self.overwrite and os.path.lexists(item.target):
            backup = stage / f".old-{item.target.name}"
            if item.directory:
                os.rename(item.target, backup)
            else:
                os.link(item.target, backup)
            item.backup = backup
            if not item.directory:
                os.replace(item.staged, item.target)
                item.placed = True
                return
        try:
            if item.directory and item.backup is None and os.path.isdir(item.target):
                os.rename(item.staged, item.target)  # onto an empty directory: ENOTEMPTY if not
            else:
                rename_noreplace(item.staged, item.target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise OutputError(f"the {item.what} appeared while this run was writing (another "
                              "run?); nothing was written; pass --overwrite to replace it",
                              path=item.target) from None
        item.placed = True

    def _rollback(self) -> None:
        for item in reversed(self._items):
            try:
                if item.directory:
                    if item.placed:
                        shutil.rmtree(item.target, ignore_errors=True)
                    if item.backup is not None:
                        os.rename(item.backup, item.target)
                elif item.backup is not None:
                    if item.placed:  # the backup is a hard link to the old file
                        os.replace(item.backup, item.target)
                elif item.placed:
                    os.unlink(item.target)
            except OSError:
                pass


def write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = True,
                inputs: Iterable[Path] = (), what: str = "output") -> None:
    """Write one small file atomically through ``Outputs``."""
    with Outputs(inputs=inputs, overwrite=overwrite) as outs:
        staged = outs.add(path, what=what)
        write_file(staged, data)


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync ``data`` to a new file at ``path`` (a staged path)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, default_mode())
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------------------------
# temp-file-and-rename for a single writer (used by the safetensors writers)
# --------------------------------------------------------------------------------------------
def open_temp(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path`` (fd, path), with the permissions ``open`` gives."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=STAGING_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, default_mode())
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


def publish(tmp: Path, path: Path) -> None:
    """Move a complete, fsynced temporary file over ``path`` (the writer's own target; whether
    ``path`` may be replaced is decided by the ``Outputs`` that staged it)."""
    os.replace(tmp, path)


def default_mode(directory: bool = False) -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename into it is durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# signals
# --------------------------------------------------------------------------------------------
class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM / SIGHUP so cleanup runs as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def terminate_on_signals():
    """While active, SIGTERM and SIGHUP raise ``Terminated`` (cleanup, then exit 128 + N)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
