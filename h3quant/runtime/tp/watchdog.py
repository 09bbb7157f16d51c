"""A hard wall-clock bound on anything a rank waits for (the rendezvous, a collective, tearing
the group down).

torch's own timeouts do not cover every wait: a TCP peer on ``MASTER_PORT`` that accepts and then
says nothing keeps the store client reading forever. ``bounded(what, seconds)`` arms a timer
thread; when the block has not returned in time the rank reports ``what`` (through the reporter
its launcher installed: a message file for a spawned rank, stderr for a torchrun rank) and ends
the process at once with ``os._exit`` -- a thread stuck in C++ cannot be interrupted any other
way, and nothing a rank holds needs flushing.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_TIMEOUT = 2  # a usage / set-up failure of the run, like every TpError

GRACE_S = 2.0  # past the operation's own timeout, so torch's clearer error wins when it comes


def _stderr(msg: str) -> None:
    try:
        sys.stderr.write(f"h3quant: error: {msg}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_TIMEOUT)


_reporter: Callable[[str], None] = _stderr


def set_reporter(fn: Callable[[str], None]) -> None:
    """How this process reports an expired bound; ``fn`` must end the process."""
    global _reporter
    _reporter = fn


@contextmanager
def bounded(what: str, seconds: float) -> Iterator[None]:
    """Run the block; if it has not returned after ``seconds`` (+ a short grace), report
    ``what`` and end the process."""
    done = threading.Event()

    def expire() -> None:
        if not done.is_set():
            try:
                _reporter(what)
            finally:
                os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(seconds + GRACE_S, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.cancel()
