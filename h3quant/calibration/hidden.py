"""The calls' hidden states of a block-major run (``capture``, ``convert --calibrate-on``), held
within a memory budget.

    store = HiddenStates(folder, call_bytes(described, hidden), budget)
    store.put(0, i, x)            # call i's state before block 0
    x = store.get(0, i)           # ... read back as block 0 runs on call i
    store.put(1, i, block(x))     # its output, the state before the next block

Every call's hidden state (``rows x hidden`` float32 values, ``rows`` the call's packed
sequence: text + 2 x audio frames + frames x ceil(H/2) x ceil(W/2)) is kept from one block to
the next. When they all fit the budget they stay in memory. Beyond it, the first calls that fit
stay in memory (leaving room for one more call, the one being read back) and the others are
spilled: each written, as soon as it is computed, to its own file in the folder (a temporary name,
then renamed) and read back when the block runs on it. A file is named after the call and the
number of blocks behind it (``hidden_{gen:03d}_{call:04d}.safetensors``); a generation's files
are removed once the next one is complete (``drop``), and ``close`` removes every file of the
store (an interrupted run's too: ``clean``).

``keep_all`` also writes the calls held in memory (``persist``): a resumable run's saved point.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from h3quant.errors import UsageError
from h3quant.sizes import GB, size_text

DEFAULT_SHARE = 0.5  # of the memory available when the run starts
FALLBACK_BUDGET = 8 * GB  # where the platform does not say what is available
_NAME = re.compile(r"^hidden_(\d{3,})_(\d{4,})\.safetensors(\.tmp)?$")


def default_budget() -> int:
    """Half the memory available now; 8 GB where the platform does not say."""
    from h3quant.formats.container.platform import available_memory_bytes

    free = available_memory_bytes()
    return int(free * DEFAULT_SHARE) if free else FALLBACK_BUDGET


def call_bytes(described: list[dict], hidden: int, itemsize: int = 4) -> list[int]:
    """Each call's hidden state in bytes, from its inputs file's dimensions (``describe_inputs``)."""
    from h3quant.limits import model_rows

    keys = ("frames", "height", "width", "audio_frames", "text_tokens")
    return [model_rows(**{k: int(d[k]) for k in keys}) * hidden * itemsize for d in described]


def file_name(gen: int, call: int) -> str:
    return f"hidden_{gen:03d}_{call:04d}.safetensors"


class HiddenStates:
    """See the module docstring. ``sizes``: each call's bytes; ``budget``: bytes (None: no
    limit); ``option``: the option named in a refusal."""

    def __init__(self, folder, sizes: list[int], budget: int | None, *, keep_all: bool = False,
                 option: str = "--memory-budget"):
        self.folder = Path(folder)
        self.sizes = list(sizes)
        self.total = sum(self.sizes)
        self.budget = budget
        self.keep_all = keep_all
        biggest = max(self.sizes, default=0)
        if budget is not None and budget < biggest:
            raise UsageError(f"{option} {size_text(budget)} cannot hold even one call's hidden "
                             f"state (the largest is {size_text(biggest)}); give at least that")
        if budget is None or self.total <= budget:
            self.resident = set(range(len(self.sizes)))
        else:  # room for the calls kept, plus the one read back
            self.resident, used = set(), 0
            for i, n in enumerate(self.sizes):
                if used + n + biggest > budget:
                    break
                self.resident.add(i)
                used += n
        self._mem: dict[int, object] = {}

    @property
    def spilled(self) -> list[int]:
        return [i for i in range(len(self.sizes)) if i not in self.resident]

    def summary(self) -> str:
        """One line: the hidden states' size, the budget and whether they fit."""
        n = len(self.sizes)
        head = f"hidden states: {size_text(self.total)} for {n} call(s)"
        if self.budget is None:
            return head + "; no memory budget: held in memory"
        head += f"; memory budget {size_text(self.budget)}"
        if not self.spilled:
            return head + ": they fit in memory"
        return (head + f": they do not fit; {len(self.spilled)} of {n} call(s) spilled to disk "
                f"in {self.folder} and read back per call as each block runs")

    # ---------------------------------------------------------------------------------- data
    def path(self, gen: int, call: int) -> Path:
        return self.folder / file_name(gen, call)

    def put(self, gen: int, call: int, x) -> None:
        """Call ``call``'s state after ``gen`` blocks: kept in memory, or written to its file."""
        if call in self.resident:
            self._mem[call] = x
        else:
            self._write(gen, call, x)

    def get(self, gen: int, call: int, device=None, dtype=None):
        """Call ``call``'s state after ``gen`` blocks (read back when spilled)."""
        if call in self.resident:
            return self._mem[call]
        return self._read(self.path(gen, call), device, dtype)

    def persist(self, gen: int) -> list[Path]:
        """Write the calls held in memory too (``keep_all``): every call's file of ``gen``."""
        for call in sorted(self.resident):
            self._write(gen, call, self._mem[call])
        return [self.path(gen, i) for i in range(len(self.sizes))]

    def adopt(self, gen: int, device=None, dtype=None) -> None:
        """Take generation ``gen`` from its files (a resumed run): the resident calls are read."""
        for call in sorted(self.resident):
            self._mem[call] = self._read(self.path(gen, call), device, dtype)

    def _write(self, gen: int, call: int, x) -> None:
        from h3quant.formats.container.writer import save_tensors

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(gen, call)
        tmp = path.with_name(path.name + ".tmp")
        save_tensors(tmp, {"x": x.detach().cpu().contiguous()})
        os.replace(tmp, path)

    def _read(self, path: Path, device, dtype):
        from h3quant.formats.container.reader import SafetensorsFile

        with SafetensorsFile(path, mmap=False) as fh:
            x = fh.read(fh.tensors["x"])
        return x.to(device=device, dtype=dtype) if device is not None or dtype else x

    # ------------------------------------------------------------------------------- clean-up
    def drop(self, gen: int) -> None:
        """Remove generation ``gen``'s files (its temporaries too)."""
        self.clean(keep=lambda g: g != gen)

    def clean(self, keep=lambda gen: False) -> None:
        """Remove the store's files (``keep(gen)`` true: kept; a temporary never is)."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            m = _NAME.match(p.name)
            if m and (m.group(3) or not keep(int(m.group(1)))):
                p.unlink(missing_ok=True)

    def close(self) -> None:
        """Forget the states and remove every file of the store."""
        self._mem.clear()
        self.clean()


def remove_empty(folder) -> None:
    """Remove ``folder`` if it is empty (a store's folder after ``close``)."""
    try:
        Path(folder).rmdir()
    except OSError:  # absent, or holding files that are not the store's
        pass


__all__ = ["DEFAULT_SHARE", "FALLBACK_BUDGET", "HiddenStates", "call_bytes", "default_budget",
           "file_name", "remove_empty"]
