"""Start N ranks (spawn) or join the group ``torchrun`` made, run a function on every rank, and
turn any rank failure into one clear ``TpError``.

``spawn_ranks(fn, world, args)`` starts ``world`` processes on this machine (a free loopback port,
``torch.multiprocessing``); each joins the group, runs ``fn(ctx, *args)`` and hands its return
value back through a file. When a rank raises, dies or is killed, the others are stopped and the
error names each failed rank and why (its own error message, or its exit code / signal).

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
from dataclasses import dataclass
from pathlib import Path

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
from h3quant.runtime.tp.env import torchrun_coords
from h3quant.runtime.tp.plan import TpError, check_world
from h3quant.runtime.tp.watchdog import set_reporter

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


def default_start_method(kind: str) -> str:
    """fork for CPU ranks on Linux (no re-import of torch: ~0.3 s instead of seconds per rank);
    spawn wherever a device runtime is involved (CUDA / NPU cannot be forked)."""
    host = device_kinds.kind(kind) is device_kinds.HOST
    return "fork" if host and sys.platform.startswith("linux") else "spawn"


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
    record = device_kinds.kind(device_kind)
    if record.indexed:
        try:
            have = record.device_count()
        except DeviceError as exc:
            raise TpError(exc.reason) from None
        if have < world:
            raise TpError(f"tp={world} needs {world} {record.label} devices, this machine has "
                          f"{have}")
    threads = max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="h3quant-tp-") as outdir:
        margs = (fn, world, free_port(), device_kind, backend, timeout_s, args, outdir,
                 comm_cls, threads)
        ctx = mp.start_processes(_child, args=margs, nprocs=world, join=False,
                                 start_method=start_method or default_start_method(device_kind))
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
