"""Signals while a command writes: SIGTERM and SIGHUP (SIGBREAK on Windows) unwind like Ctrl-C, and the few moments
that must not be cut in two (loading torch, the final move of the outputs) defer them.

* ``terminate_on_signals()``: while active (main thread only), SIGTERM and SIGHUP raise
  ``Terminated`` so staging is removed as on SIGINT; the exit status is 128 + N.
* ``deferred_signals()``: a critical section. SIGTERM, SIGHUP and SIGINT arriving inside it are
  recorded and delivered again, to the handlers in force before it, as soon as it ends. Python
  code running inside (an import machinery that catches ``BaseException``, a rename and its
  rollback) never sees the signal half way.
* ``note_committed()`` / ``interrupt_outcome()``: once a command's outputs are all in place, a
  late signal no longer means "nothing written": the CLI then reports the outputs as complete and
  exits 0, so the exit status always says whether the outputs exist.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from h3quant.formats.container.platform import DEFERRED_SIGNALS, TERMINATION_SIGNALS

_DEFERRED = DEFERRED_SIGNALS
_committed: list[Path] = []


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM / SIGHUP so cleanup runs as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _handling(signals, handler) -> Iterator[None]:
    """``handler`` for each of ``signals`` while the block runs (those Python may not handle
    here are skipped); the previous handlers are put back however the block ends."""
    previous = {}
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def terminate_on_signals() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise ``Terminated`` (cleanup, then exit 128 + N)."""
    if not _in_main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    with _handling(TERMINATION_SIGNALS, handler):
        yield


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGTERM, SIGHUP and SIGINT for the duration of the block, then deliver the first
    one that arrived (to the handlers in force before the block). Outside the main thread this
    does nothing (Python delivers signals to the main thread only)."""
    if not _in_main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum, frame):
        pending.append(signum)

    try:
        with _handling(_DEFERRED, record):
            yield
    finally:  # also when the block raised, as a signal that arrived must not be lost
        if pending:
            signal.raise_signal(pending[0])  # runs the restored handler (may raise)


def note_committed(paths) -> None:
    """Record that these outputs are complete and in place (called by ``Outputs.commit``)."""
    _committed.extend(Path(p) for p in paths)


def committed_outputs() -> list[Path]:
    """Every output this process has put in place so far."""
    return list(_committed)


def forget_committed() -> None:
    _committed.clear()


def interrupt_outcome(exc: BaseException, committed_before: int = 0) -> tuple[int, str]:
    """Exit status and message for an interrupt (Ctrl-C, ``Terminated``) reaching the CLI.

    Outputs put in place after ``committed_before`` (a count from ``committed_outputs``) mean the
    command's work is complete: exit 0, saying so. Otherwise nothing was written: 128 + N."""
    code = getattr(exc, "exit_code", 130)
    what = "interrupted" if code == 130 else f"terminated by signal {code - 128}"
    done = _committed[committed_before:]
    if done:
        names = ", ".join(str(p) for p in done)
        return 0, f"h3quant: {what} after the outputs were complete ({names})"
    return code, f"h3quant: {what} (nothing written)"
