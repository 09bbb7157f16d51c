"""Start N ranks (spawn) or join the group ``torchrun`` made, run a function on every rank, and
turn any rank failure into one clear ``TpError``.

``spawn_ranks(fn, world, args)`` starts ``world`` processes on this machine (a free loopback port,
``torch.multiprocessing``); each joins the group, runs ``fn(ctx, *args)`` and hands its return
value back through a file. When a rank raises, dies or is killed, the others are stopped and the
error names each failed rank and why (its own error message, or its exit code / signal).

``plan_launch(tp, device)`` makes every check a ``--tp N`` command needs before it reads
anything (the checked torchrun coordinates, the device present, its kind's backend usable here,
enough devices for N spawned ranks) and returns the ``Launch``; ``Launch.run(fn, args)`` then
joins torchrun's group or spawns the ranks. ``verify --tp`` and ``capture --tp`` both start
their ranks this way, so they refuse the same things with the same messages.

``join_torchrun(fn, world, args)`` runs ``fn`` in this process when it was started by ``torchrun``
(``h3quant.runtime.tp.env``: its variables and ``TORCHELASTIC_RUN_ID`` set): one rank of a
group that may span machines. Rank 0 gets ``fn``'s result; the others get None.

Every wait of a rank is bounded (``h3quant.runtime.tp.watchdog``): a spawned rank whose bound
expires leaves its message for the parent; a torchrun rank prints it and exits 2.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant import device_kinds
from h3quant.errors import DeviceError, H3QuantError
from h3quant.runtime.tp.group import (
    DEFAULT_TIMEOUT_S,
    Collectives,
    backend_for,
    check_backend,
    destroy_group,
    init_group,
)
from h3quant.runtime.tp.env import launched_by_torchrun, torchrun_coords
from h3quant.runtime.tp.plan import TpError, check_world
from h3quant.runtime.tp.watchdog import set_reporter

if TYPE_CHECKING:
    from h3quant.runtime.probe import Probe

_RANK_FAILED = 3  # exit code of a rank that reported its own error


@dataclass
class RankContext:
    """What ``fn`` gets on each rank."""

    rank: int
    world: int
    local_rank: int
    device: str  # "cpu", "cuda:<local_rank>", "npu:<local_rank>"
    backend: str
    comm: Collectives
    timeout_s: float


def rank_device(kind: str, local_rank: int) -> str:
    """The rank's own device string (``cuda:<local_rank>``), made current on its kind."""
    record = device_kinds.kind(kind)
    if not record.indexed:
        return kind
    try:
        record.set_device(local_rank)
    except DeviceError as exc:
        raise TpError(exc.reason) from None
    return f"{kind}:{local_rank}"


def check_device_count(kind: str, world: int, who: str | None = None) -> None:
    """TpError when this machine has fewer than ``world`` devices of ``kind`` (spawned ranks
    each take their own; ``who`` names what needs them, ``tp=N`` by default)."""
    record = device_kinds.kind(kind)
    if not record.indexed:
        return
    try:
        have = record.device_count()
    except DeviceError as exc:
        raise TpError(exc.reason) from None
    if have < world:
        raise TpError(f"{who or f'tp={world}'} needs {world} {record.label} devices, this "
                      f"machine has {have}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, fn, world, port, kind, backend, timeout_s, args, outdir, comm_cls, threads):
    """Body of one spawned rank (module level: picklable for the spawn start method)."""
    import torch

    torch.set_num_threads(threads)
    out = Path(outdir)

    def report(msg: str) -> None:
        (out / f"rank{rank}.err").write_text(msg, encoding="utf-8")
        os._exit(_RANK_FAILED)

    set_reporter(report)
    try:
        init_group(backend, rank, world, timeout_s, addr="127.0.0.1", port=port)
        ctx = RankContext(rank, world, rank, rank_device(kind, rank), backend,
                          comm_cls(rank, world, timeout_s), timeout_s)
        result = fn(ctx, *args)
    except BaseException as exc:  # noqa: BLE001 (report anything, then exit: the parent stops the others)
        report(str(exc) if isinstance(exc, H3QuantError)
               else f"unexpected {type(exc).__name__}: {exc}")
    destroy_group(timeout_s)
    with open(out / f"rank{rank}.pkl", "wb") as fh:
        pickle.dump(result if rank == 0 else None, fh)


def default_start_method(kind: str, world: int = 1) -> str:
    """fork for CPU ranks on Linux when each rank gets one thread (no re-import of torch: ~0.3 s
    instead of seconds per rank); spawn otherwise: wherever a device runtime is involved (CUDA /
    NPU cannot be forked), and where the ranks would run several threads each (a forked child
    that starts an OpenMP team after its parent ran one hangs: GNU libgomp is not fork-safe)."""
    host = device_kinds.kind(kind) is device_kinds.HOST
    one_thread = (os.cpu_count() or 1) // world <= 1
    return "fork" if host and one_thread and sys.platform.startswith("linux") else "spawn"


def rank_threads(world: int, start_method: str) -> int:
    """Intra-op threads of each rank: one in a forked rank (see ``default_start_method``), else
    the machine's cores shared among the ranks."""
    return 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world)


def spawn_ranks(fn, world: int, args: tuple = (), *, device_kind: str = "cpu",
                backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                start_method: str | None = None, comm_cls=Collectives,
                deadline_s: float | None = None):
    """Run ``fn(ctx, *args)`` on ``world`` local ranks; returns rank 0's result.

    ``deadline_s``: an overall wall-clock limit (None: none; every collective is bounded by
    ``timeout_s`` anyway)."""
    import torch.multiprocessing as mp

    check_world(world)
    backend = backend or backend_for(device_kind)
    check_backend(backend)
    check_device_count(device_kind, world)
    method = start_method or default_start_method(device_kind, world)
    with tempfile.TemporaryDirectory(prefix="h3quant-tp-") as outdir:
        margs = (fn, world, free_port(), device_kind, backend, timeout_s, args, outdir,
                 comm_cls, rank_threads(world, method))
        ctx = mp.start_processes(_child, args=margs, nprocs=world, join=False,
                                 start_method=method)
        start = time.monotonic()
        try:
            while not ctx.join(timeout=0.5, grace_period=2.0):
                if deadline_s is not None and time.monotonic() - start > deadline_s:
                    _kill(ctx)
                    raise TpError(f"tensor-parallel run exceeded its {deadline_s:g} s deadline; "
                                  "all ranks stopped")
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            raise TpError(_failure_summary(ctx, Path(outdir), world)) from None
        except KeyboardInterrupt:
            _kill(ctx)
            raise
        with open(Path(outdir) / "rank0.pkl", "rb") as fh:
            return pickle.load(fh)


def _kill(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join()


def _failure_summary(ctx, outdir: Path, world: int) -> str:
    """One line per failed rank; the root cause (an error that is not a collective failure, or a
    rank that died) first."""
    own: dict[str, list[int]] = {}
    died, follow = [], []
    for r, p in enumerate(ctx.processes):
        p.join(timeout=5)
        err = outdir / f"rank{r}.err"
        if err.exists():
            msg = err.read_text(encoding="utf-8").strip()
            if "failed after at most" in msg:
                follow.append(msg)
            else:
                own.setdefault(msg, []).append(r)
        elif p.exitcode not in (0, None):
            how = (f"killed by signal {-p.exitcode}" if p.exitcode < 0
                   else f"exit code {p.exitcode}")
            died.append(f"rank {r} died ({how})")
    mine = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
            for msg, rs in own.items()]
    parts = mine + died + follow
    return "tensor-parallel run failed: " + " | ".join(parts or ["a rank failed"])


def join_torchrun(fn, world: int | None, args: tuple = (), *, device_kind: str = "cpu",
                  backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  comm_cls=Collectives):
    """Run ``fn`` as this process's rank of the torchrun group; rank 0 gets the result."""
    coords = torchrun_coords(tp=world)
    rank, size, local = coords.rank, coords.world, coords.local_rank
    backend = backend or backend_for(device_kind)
    init_group(backend, rank, size, timeout_s)
    try:
        ctx = RankContext(rank, size, local, rank_device(device_kind, local), backend,
                          comm_cls(rank, size, timeout_s), timeout_s)
        result = fn(ctx, *args)
    finally:
        destroy_group(timeout_s)
    return result if rank == 0 else None


@dataclass(frozen=True)
class Launch:
    """How a ``--tp N`` run starts (``plan_launch``): torchrun's group or N spawned ranks, each
    on its own device of ``kind`` with that kind's backend."""

    world: int
    kind: str
    torchrun: bool
    rank: int = 0  # this process's rank under torchrun; 0 when spawning (the parent reports)

    def run(self, fn, args: tuple = (), *, backend: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str | None = None,
            comm_cls=Collectives):
        """``fn(ctx, *args)`` on every rank; rank 0's result (None on torchrun's other ranks).
        ``backend``: the torch.distributed backend instead of the kind's (tests)."""
        if self.torchrun:
            return join_torchrun(fn, self.world, args, device_kind=self.kind, backend=backend,
                                 timeout_s=timeout_s, comm_cls=comm_cls)
        return spawn_ranks(fn, self.world, args, device_kind=self.kind, backend=backend,
                           timeout_s=timeout_s, start_method=start_method, comm_cls=comm_cls)


def plan_launch(tp: int | None, device, *, backend: str | None = None) -> Launch:
    """Every check of a ``--tp N`` run on ``device`` (a device string or ``Device``) that needs
    no file, in this order: N itself; under torchrun its coordinates (``--tp`` must equal
    WORLD_SIZE); the device present (``require_device``: the CLI's message); a kind with a
    torch.distributed backend (mps has none); that backend usable in this torch (and
    ``backend``, the transport a test runs instead, too); N devices of the kind on this
    machine when the ranks are spawned here (under torchrun: this rank's LOCAL_RANK device)."""
    from h3quant.runtime.availability import require_device

    if tp is None:
        raise TpError("--tp N is required (under torchrun too: the number of ranks)")
    check_world(tp)
    torchrun = launched_by_torchrun()
    # under torchrun a malformed RANK / WORLD_SIZE is a usage error, before anything starts
    coords = torchrun_coords(tp=tp) if torchrun else None
    kind = require_device(device).kind
    check_backend(backend_for(kind))
    if backend is not None:  # the transport a test or simulation runs instead
        check_backend(backend)
    if coords is None:
        check_device_count(kind, tp)
        return Launch(tp, kind, False)
    local = coords.local_rank  # this rank's device: LOCAL_RANK's
    check_device_count(kind, local + 1, f"torchrun's LOCAL_RANK={local}")
    return Launch(tp, kind, True, coords.rank)


@contextmanager
def rank_setup_probe(ctx: RankContext, setup=None) -> Iterator[Probe | None]:
    """Inside a rank: None (the caller asks the live machine), or with ``setup`` (tests and
    simulations: ``setup(ctx)`` is a context manager giving ``(probe, device)``) that probe,
    with ``ctx.device`` replaced by ``device`` when it is not None, for the whole block."""
    if setup is None:
        yield None
        return
    with setup(ctx) as (probe, device):
        if device is not None:
            ctx.device = device
        yield probe
