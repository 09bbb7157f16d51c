"""One place that knows every file a command reads and every file it writes.

Rule: every file a command reads is an input, and no output may name an input. A checkpoint,
its shards and index, a LoRA, a recipe, an ``--inputs`` latents file, a saved ``--from`` pass,
a reference, a card or calibration statistics: all of them are inputs. An output (``OUT``,
``--report``, ``--out``, ``--plot``, ...) that is one of them (same path, a link to it, the same
inode, or inside an input directory) is refused before any work, with exit status 2, and the
input is left as it was.

How a command uses it (and how a new command registers its files)::

    files = CommandFiles("convert")
    files.checkpoint(src)                       # IN: the path, and a directory's entries
    files.read(recipe_path, "recipe")           # every other file the command reads
    for spec in loras: files.read(lora_path(spec), "LoRA")
    files.write(dst, "output", directory=...)   # every file it will write
    files.write(report_path, "report")
    files.check(overwrite=overwrite)            # before any work: OutputError (exit 2)
    ...
    with files.transaction(overwrite=overwrite, log=log) as outs:   # the atomic output rules
        staged = outs.add(dst)                  # checked again against every input
        files.read(shard)                       # inputs found later still count

``None`` paths are ignored, so optional options can be registered unconditionally. The same
object is handed to ``formats.container.atomic.Outputs`` (``Outputs(files=...)``), so the checks
at staging time and at the final move see every input the command registered, including those
added after the early check.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path



_current: CommandFiles | None = None


def current() -> CommandFiles | None:
    """The files of the command now running (the last ``CommandFiles`` made), or None: an
    operating-system error that names no file (a full disk, an allocation refused) is reported
    with the files it can only be about."""
    return _current


def forget_current() -> None:
    """A new command starts: no files are known yet."""
    global _current
    _current = None


@dataclass(frozen=True)
class FileUse:
    path: Path
    what: str
    directory: bool = False


@dataclass
class CommandFiles:
    """The inputs and outputs of one command run (see the module docstring)."""

    command: str = "h3quant"
    inputs: list[FileUse] = field(default_factory=list)
    outputs: list[FileUse] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _current
        _current = self  # what an operating-system error is about (see ``current``)

    # -- registration ---------------------------------------------------------------------
    def read(self, path: str | os.PathLike | None, what: str = "input") -> Path | None:
        """Register a file the command reads (None: nothing)."""
        if path is None or str(path) == "":
            return None
        p = Path(path)
        if all(u.path != p for u in self.inputs):
            self.inputs.append(FileUse(p, what))
        return p

    def checkpoint(self, path: str | os.PathLike | None, what: str = "input") -> Path | None:
        """Register a checkpoint: the path as named and, for a directory, each file in it."""
        p = self.read(path, what)
        if p is not None and p.is_dir():
            try:
                for name in sorted(os.listdir(p)):
                    self.read(p / name, f"{what} shard")
            except OSError:
                pass
        return p

    def write(self, path: str | os.PathLike | None, what: str = "output",
              directory: bool = False) -> Path | None:
        """Register a file (or, ``directory``, a folder) the command writes."""
        if path is None or str(path) == "":
            return None
        p = Path(path)
        self.outputs.append(FileUse(p, what, directory))
        return p

    # -- views ----------------------------------------------------------------------------
    @property
    def input_paths(self) -> list[Path]:
        return [u.path for u in self.inputs]

    def what_reads(self, path: Path) -> str:
        for u in self.inputs:
            if u.path == path:
                return u.what
        return "input"

    # -- the rules ------------------------------------------------------------------------
    def check(self, *, overwrite: bool = False) -> None:
        """Refuse, before any work, an output that names an input or another output.

        Only the input/output rule is checked here (existence without ``overwrite`` and the
        other output rules are checked by ``Outputs`` when the output is staged)."""
        from h3quant.formats.container.atomic import check_not_input, check_outputs_distinct

        for out in self.outputs:
            check_not_input(out.path, self.input_paths, directory=out.directory,
                            what=out.what, names=self.what_reads)
        check_outputs_distinct([o.path for o in self.outputs])

    def transaction(self, *, overwrite: bool = False,
                    log: Callable[[str], None] | None = None):
        """The atomic ``Outputs`` of this command, checking against every registered input."""
        from h3quant.formats.container.atomic import Outputs

        return Outputs(files=self, overwrite=overwrite, log=log)
