"""A simulated commit limit: a machine with less memory than the checkpoint, for any file size.

``python -m h3quant.testing.sim_commit LIMIT ARGS...`` runs ``h3quant ARGS`` with ``mmap.mmap``
charging every private writable mapping (``ACCESS_COPY``, or ``MAP_PRIVATE`` with
``PROT_WRITE``) against a commit limit of ``LIMIT`` bytes, the way the operating systems do:

* Linux, ``vm.overcommit_memory = 0`` (the default heuristic): a single private writable mapping
  larger than RAM plus swap is refused with ``ENOMEM`` ("Cannot allocate memory");
* Linux, ``vm.overcommit_memory = 2``, and Windows: the sum of the live charges may not exceed
  the commit limit (RAM plus swap or page file); Windows refuses a copy-on-write view beyond it
  with ``ERROR_COMMITMENT_LIMIT``.

The simulation applies the stricter, second rule (which implies the first). Read-only and
shared mappings are not charged (the page cache backs them), as on both systems. What it cannot
show: memory the process allocates otherwise (tensors, buffers), which the real limit also
counts; the real-size benchmark (``bench/bench_bigfile.py``) runs the real kernel's rule.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import weakref

_state = {"limit": 0, "charged": 0, "refused": 0}
_lock = threading.Lock()


def _private_writable(kw: dict) -> bool:
    access = kw.get("access", mmap.ACCESS_DEFAULT)
    if access == mmap.ACCESS_COPY:
        return True
    if access in (mmap.ACCESS_READ, mmap.ACCESS_WRITE):
        return False
    flags = kw.get("flags", getattr(mmap, "MAP_SHARED", 1))
    prot = kw.get("prot", getattr(mmap, "PROT_READ", 1) | getattr(mmap, "PROT_WRITE", 2))
    return bool(flags & getattr(mmap, "MAP_PRIVATE", 2)) and bool(
        prot & getattr(mmap, "PROT_WRITE", 2))


def _release(n: int) -> None:
    with _lock:
        _state["charged"] -= n


class ChargedMmap(mmap.mmap):
    """``mmap.mmap`` whose private writable mappings count against the simulated limit."""

    _charge: weakref.finalize | None  # releases this mapping's charge (None: not charged)

    def __new__(cls, fileno, length, *args, **kw):
        if args:
            raise TypeError("the simulated mmap takes its options as keywords")
        charge = 0
        if _private_writable(kw):
            charge = length or os.fstat(fileno).st_size - kw.get("offset", 0)
            with _lock:
                if _state["charged"] + charge > _state["limit"]:
                    _state["refused"] += 1
                    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
                _state["charged"] += charge
        try:
            self = super().__new__(cls, fileno, length, **kw)
        except BaseException:
            _release(charge)
            raise
        self._charge = weakref.finalize(self, _release, charge) if charge else None
        return self

    def close(self) -> None:
        super().close()
        if self._charge is not None:
            self._charge()  # unmapped now: the charge goes at once (a finalizer runs once)


def simulate_commit_limit(limit: int) -> None:
    """Install the charged ``mmap.mmap`` in this interpreter (before h3quant maps anything)."""
    _state["limit"] = int(limit)
    mmap.mmap = ChargedMmap  # type: ignore[misc]


def main(argv: list[str]) -> None:
    simulate_commit_limit(int(argv[0]))
    from h3quant.cli import main as cli_main

    cli_main.main(argv[1:], prog_name="h3quant")


if __name__ == "__main__":
    main(sys.argv[1:])
