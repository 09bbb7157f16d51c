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
* ``--overwrite`` moves the previous output aside inside the staging directory, journaled: a
  run killed at any moment (even SIGKILL) leaves enough for the next run to put it back, and a
  staging directory still holding a previous output is never deleted.
* SIGTERM and SIGHUP (``terminate_on_signals``) unwind like SIGINT, so staging is removed; the
  final move itself defers them until every output is in place (``signals``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from h3quant.errors import OutputError
from h3quant.formats.container.platform import open_fd, rename_noreplace, set_mode, try_lock
from h3quant.formats.container.signals import (  # noqa: F401 (Terminated, terminate_on_signals: re-exported)
    Terminated,
    deferred_signals,
    note_committed,
    terminate_on_signals,
)

STAGING_PREFIX = ".h3quant-staging-"
STAGING_SUFFIX = ".tmp"
_UNLOCKED_SUFFIX = ".new"  # a staging directory before its lock is held (never cleaned as stale)
LOCK_NAME = ".lock"
MANIFEST_NAME = ".h3quant-output.json"
MANIFEST_KIND = "h3quant-output"


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
    body = (json.dumps({"kind": MANIFEST_KIND, "files": files}, indent=2) + "\n").encode()
    fd, tmp = open_temp(directory / MANIFEST_NAME)  # replaced in one step, never half written
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, directory / MANIFEST_NAME)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    if is_staging_name(path.name):
        raise OutputError(f"the {what}'s name is reserved for h3quant's temporary staging "
                          f"directories ({STAGING_PREFIX}*{STAGING_SUFFIX}), which a later run "
                          "may remove; choose another name", path=path)
    check_not_input(path, inputs, directory=directory, what=what)
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


INDEX_SUFFIX = ".index.json"


def check_not_input(path: Path, inputs: Iterable[Path], *, directory: bool = False,
                    what: str = "output", names: Callable[[Path], str] | None = None) -> None:
    """Refuse an output that is an input (same path, a link to it, the same inode), or a
    directory output holding an input, or an output inside an input directory."""
    path = Path(path)
    st = _stat(path)
    inputs = [Path(p) for p in inputs]
    for inp in inputs:
        ist = _stat(inp)
        same = os.path.abspath(inp) == os.path.abspath(path) or (
            st is not None and ist is not None and _same_inode(st, ist))
        if not same and st is not None and ist is not None:
            try:
                same = path.resolve() == inp.resolve()
            except (OSError, RuntimeError):
                pass
        if same:
            kind = names(inp) if names else "input"
            kind = "" if kind == "input" else f"the {kind}, "
            raise OutputError(f"the {what} is the input {inp} ({kind}a file this command "
                              "reads); choose another path", path=path)
        if directory and ist is not None:
            try:
                Path(inp).resolve().relative_to(path.resolve())
                raise OutputError(f"the {what} directory contains the input {inp}; "
                                  "choose another path", path=path)
            except ValueError:
                pass
    for folder in input_dirs(inputs):
        if _is_within(path, folder):
            raise OutputError(f"the {what} is inside the input directory {folder} (its shards "
                              "live there); choose a path outside it", path=path)


def input_dirs(inputs: Iterable[Path]) -> list[Path]:
    """The directories an input occupies: an input that is a directory, and the directory of a
    shard index (its shards live there). Outputs never go inside them."""
    dirs = []
    for inp in inputs:
        inp = Path(inp)
        if inp.is_dir():
            dirs.append(inp)
        elif inp.name.endswith(INDEX_SUFFIX):
            dirs.append(inp.parent)
    return dirs


def _is_within(path: Path, folder: Path) -> bool:
    try:
        (path.parent.resolve() / path.name).relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


def checkpoint_inputs(*paths: str | os.PathLike | None) -> list[Path]:
    """What a command reading these checkpoints counts as its inputs for the output rules: each
    path as named (a file, an index or a directory), and each file of a directory checkpoint."""
    out: list[Path] = []
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        out.append(p)
        if p.is_dir():
            try:
                out.extend(p / n for n in sorted(os.listdir(p)))
            except OSError:
                pass
    return out


def check_outputs_distinct(paths: Iterable[Path]) -> None:
    seen: dict[str, Path] = {}
    for p in paths:
        key = os.path.normcase(os.path.abspath(Path(p).parent.resolve() / Path(p).name))
        if key in seen:
            raise OutputError(f"two outputs name the same file ({seen[key]} and {p})", path=p)
        seen[key] = Path(p)
    stats: dict[tuple[int, int], Path] = {}
    for p in paths:
        st = _stat(Path(p))
        if st is not None:
            k = (st.st_dev, st.st_ino)
            if k in stats:
                raise OutputError(f"two outputs are the same file ({stats[k]} and {p})", path=p)
            stats[k] = p


# --------------------------------------------------------------------------------------------
# staging, the commit journal and stale temporaries
# --------------------------------------------------------------------------------------------
# A staging directory ``.h3quant-staging-<pid>-<random>.tmp`` beside the outputs holds:
#   .lock          flock'ed while its run lives
#   new/NAME       each output while it is written
#   old/NAME       the previous output NAME while the final move replaces it (--overwrite)
#   journal.json   written (and fsynced) before the first move: each output's name and the
#                  inode of its new version, so a later run can tell what was moved
#   committed      written once every output is in place: the run is complete
# A killed run's directory is resolved by the next run writing beside it (``recover``): a
# complete run's leftovers are removed; an incomplete run is rolled back (its new outputs
# removed, every previous output moved back). A previous output that cannot be moved back is
# kept where it is, and so is the staging directory holding it, and the user is told.
NEW_DIR = "new"
OLD_DIR = "old"
JOURNAL_NAME = "journal.json"
COMMITTED_NAME = "committed"
_LEGACY_BACKUP = ".old-"  # older releases kept the previous output at <stage>/.old-NAME


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another process holds it."""
    try:
        fd = open_fd(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    if not try_lock(fd):
        os.close(fd)
        return None
    return fd


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _read_journal(stage: Path) -> list[dict] | None:
    try:
        raw = (stage / JOURNAL_NAME).read_bytes()
        obj = json.loads(raw.decode("utf-8")) if len(raw) < 1 << 24 else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    items = obj.get("outputs") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        return None
    good = []
    for it in items:
        if (isinstance(it, dict) and isinstance(it.get("name"), str)
                and isinstance(it.get("ino"), int) and isinstance(it.get("dev"), int)):
            name = it["name"]
            if name and "/" not in name and name not in (".", ".."):
                good.append(it)
    return good


def _write_small(path: Path, data: bytes) -> None:
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(stage: Path, parent: Path, log: Callable[[str], None] | None = None) -> bool:
    """Resolve the staging directory ``stage`` (in ``parent``) of a run that did not finish.

    A complete run (``committed``) only leaves files to remove. Otherwise each output it moved
    into place is taken back and each previous output it moved aside is put back. Returns True
    when nothing of the user's is left in ``stage`` (it may be removed), False when a previous
    output had to stay there (its place is taken): the caller keeps the directory."""
    say = log or (lambda msg: None)
    if (stage / COMMITTED_NAME).exists():
        return True
    safe = True
    journal = _read_journal(stage) or []
    old_dir = stage / OLD_DIR
    for it in reversed(journal):
        name = it["name"]
        target, backup = parent / name, old_dir / name
        try:
            tst = os.lstat(target)
        except FileNotFoundError:
            tst = None
        has_backup = os.path.lexists(backup)
        if tst is not None and (tst.st_dev, tst.st_ino) == (it["dev"], it["ino"]):
            # our new output is in place: take it back (it was never complete as a set)
            if has_backup and not it.get("directory"):
                os.replace(backup, target)  # the previous file comes back in one step
                say(f"h3quant: restored {target} (an interrupted run had replaced it)")
                continue
            _remove(target)
            tst = None
        if not has_backup:
            continue
        if tst is None:
            os.rename(backup, target)
            say(f"h3quant: restored {target} (an interrupted run had moved it aside)")
        elif not it.get("directory") and os.path.samestat(tst, os.lstat(backup)):
            os.unlink(backup)  # only a second link to the file that never left its place
        else:
            safe = False
            say(f"h3quant: kept the previous {target} at {backup}: an interrupted run had "
                "moved it aside and its place is taken now")
    # releases before the journal kept a replaced output at <stage>/.old-NAME
    try:
        legacy = [n for n in os.listdir(stage) if n.startswith(_LEGACY_BACKUP)]
    except OSError:
        legacy = []
    for n in legacy:
        target, backup = parent / n[len(_LEGACY_BACKUP):], stage / n
        if not os.path.lexists(target):
            os.rename(backup, target)
            say(f"h3quant: restored {target} (an interrupted run had moved it aside)")
        elif not (backup.is_file() and os.path.samestat(os.lstat(target), os.lstat(backup))):
            safe = False
            say(f"h3quant: kept the previous {target} at {backup}: an interrupted run had "
                "moved it aside and its place is taken now")
    if old_dir.is_dir() and os.listdir(old_dir):
        safe = False  # a previous output nobody journaled: never delete it
        say(f"h3quant: kept {old_dir}: it holds a previous output of an interrupted run")
    return safe


def is_staging_name(name: str) -> bool:
    """True for names h3quant gives its staging directories (never allowed as an output)."""
    return name.startswith(STAGING_PREFIX) and (name.endswith(STAGING_SUFFIX)
                                                or name.endswith(_UNLOCKED_SUFFIX))


def _looks_like_stage(stage: Path) -> bool:
    """Not an output directory (one holding h3quant's output manifest, as an OUT named like a
    staging directory by an older release would): such a directory is the user's, never
    removed."""
    return not os.path.lexists(stage / MANIFEST_NAME)


def clean_stale(directory: Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Resolve and remove staging directories left by killed runs (their lock is free).

    A previous output that such a run had moved aside is put back first (``recover``); a
    staging directory that still holds one is kept, never deleted."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(STAGING_PREFIX) and name.endswith(STAGING_SUFFIX)):
            continue
        stage = Path(directory) / name
        if stage.is_symlink() or not stage.is_dir() or not _looks_like_stage(stage):
            continue  # named like one, but not h3quant's: never touched
        fd = _try_lock(stage / LOCK_NAME)
        if fd is None:
            continue  # a live run holds it
        try:
            try:
                safe = recover(stage, Path(directory), log)
            except OSError as exc:
                safe = False
                if log:
                    log(f"h3quant: kept {stage} (an interrupted run's temporary): it could not "
                        f"be resolved ({exc.strerror or exc})")
            if not safe:
                continue
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
        self.parent = parent
        born = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-",
                                     suffix=_UNLOCKED_SUFFIX, dir=parent))
        self.lock_fd = _try_lock(born / LOCK_NAME)
        os.mkdir(born / NEW_DIR)
        os.mkdir(born / OLD_DIR)
        self.path = born.with_name(born.name[:-len(_UNLOCKED_SUFFIX)] + STAGING_SUFFIX)
        os.rename(born, self.path)

    @property
    def new(self) -> Path:
        return self.path / NEW_DIR

    @property
    def old(self) -> Path:
        return self.path / OLD_DIR

    def remove(self, log: Callable[[str], None] | None = None) -> None:
        """Remove the directory, unless it still holds a previous output (then say where)."""
        try:
            held = bool(os.listdir(self.old))
        except OSError:
            held = False
        if held and not (self.path / COMMITTED_NAME).exists():
            if log:
                log(f"h3quant: kept {self.old}: it holds the previous output(s), which could "
                    "not be moved back")
        else:
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
    stage: _Stage


class Outputs:
    """The outputs of one command, staged and committed together.

    ::

        with Outputs(inputs=[src], overwrite=False, log=log) as outs:
            tmp = outs.add(dst)                 # checked now; write to ``tmp``
            rep = outs.add(report, what="report")
            ...write both...
        # both are in place here; after an exception neither is, and nothing is left behind

    A directory output (``directory=True``) is created empty at the staged path; its manifest
    is written at commit. The final move is a critical section: SIGTERM, SIGHUP and SIGINT
    arriving during it are delivered once every output is in place (or every one rolled back).
    """

    def __init__(self, *, inputs: Iterable[Path] = (), overwrite: bool = False,
                 log: Callable[[str], None] | None = None, files=None):
        # ``files``: the command's ``iofiles.CommandFiles``; its inputs (also those registered
        # later) are checked with ``inputs`` at staging and at the final move
        self._given_inputs = [Path(p) for p in inputs]
        self.files = files
        self.overwrite = overwrite
        self.log = log
        self._items: list[_Item] = []
        self._stages: dict[Path, _Stage] = {}

    @property
    def inputs(self) -> list[Path]:
        extra = self.files.input_paths if self.files is not None else []
        return self._given_inputs + [p for p in extra if p not in self._given_inputs]

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
        staged = stage.new / target.name
        if directory:
            os.mkdir(staged, default_mode(directory=True))
        self._items.append(_Item(target, staged, directory, what, stage))
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
            stage.remove(self.log)
        self._stages.clear()

    def commit(self) -> None:
        """Move every staged output into place, or none (earlier ones are rolled back)."""
        for item in self._items:
            try:
                if item.directory:
                    write_manifest(item.staged)
                    fsync_dir(item.staged)
                elif item.staged.exists():
                    os.chmod(item.staged, default_mode())
                else:
                    raise OutputError(f"the {item.what} was never written", path=item.target)
            except BaseException:
                self.abort()
                raise
        with deferred_signals():
            try:
                self._journal()
                for item in self._items:
                    self._place(item)
                for parent in {i.target.parent for i in self._items}:
                    fsync_dir(parent)
                for stage in self._stages.values():
                    _write_small(stage.path / COMMITTED_NAME, b"complete\n")
            except BaseException:
                self._rollback()
                self.abort()
                raise
            self.abort()  # removes the staging directories (and any replaced old output)
            note_committed(i.target for i in self._items)

    def _journal(self) -> None:
        for stage in self._stages.values():
            entries = []
            for item in self._items:
                if item.stage is stage:
                    st = os.lstat(item.staged)
                    entries.append({"name": item.target.name, "directory": item.directory,
                                    "dev": st.st_dev, "ino": st.st_ino})
            _write_small(stage.path / JOURNAL_NAME,
                         json.dumps({"outputs": entries}).encode("utf-8"))
            fsync_dir(stage.path)

    def _place(self, item: _Item) -> None:
        # re-check at the last moment: the path may have changed while we worked
        if not self.overwrite and os.path.lexists(item.target) and not (
                item.directory and os.path.isdir(item.target) and not os.listdir(item.target)):
            raise OutputError(f"the {item.what} appeared while this run was writing (another "
                              "run?); nothing was written; pass --overwrite to replace it",
                              path=item.target)
        check_output(item.target, directory=item.directory, overwrite=self.overwrite,
                     inputs=self.inputs, what=item.what)
        if self.overwrite and os.path.lexists(item.target):
            backup = item.stage.old / item.target.name
            if item.directory:
                os.rename(item.target, backup)  # journaled: a killed run's is moved back
            else:
                os.link(item.target, backup)  # the old file never leaves its place
                os.replace(item.staged, item.target)
                return
        try:
            if item.directory and os.path.isdir(item.target) and not os.path.islink(item.target):
                os.rename(item.staged, item.target)  # onto an empty directory: ENOTEMPTY if not
            else:
                rename_noreplace(item.staged, item.target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise OutputError(f"the {item.what} appeared while this run was writing (another "
                              "run?); nothing was written; pass --overwrite to replace it",
                              path=item.target) from None

    def _rollback(self) -> None:
        for stage in self._stages.values():
            try:
                recover(stage.path, stage.parent, self.log)
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
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, default_mode())
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------------------------
# temp-file-and-rename for a single writer (used by the safetensors writers)
# --------------------------------------------------------------------------------------------
def open_temp(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path`` (fd, path), with the permissions ``open`` gives."""
    # the name is cut so the temporary stays within NAME_MAX whatever the output is called
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=STAGING_SUFFIX,
                               dir=path.parent)
    try:
        set_mode(fd, tmp, default_mode())
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
        fd = open_fd(path, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def resolve_stale(paths: Iterable[str | os.PathLike | None],
                  log: Callable[[str], None] | None = None) -> None:
    """Resolve killed runs' staging directories beside each of ``paths`` (``clean_stale``)
    before the outputs are checked, so a run that died between its outputs' moves is undone
    first (its lone output would otherwise look like an existing file)."""
    seen = set()
    for p in paths:
        if p is None:
            continue
        parent = Path(p).parent
        if parent.is_dir() and parent.resolve() not in seen:
            seen.add(parent.resolve())
            clean_stale(parent, log)
