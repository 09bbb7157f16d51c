"""The process group and the only collectives tensor parallel uses, each with a timeout.

Backend from the device (FORMATS.md 7): ``gloo`` for CPU processes, ``nccl`` for CUDA, ``hccl``
for Ascend (registered by ``torch_npu``; ``torch.npu.set_device(local_rank)`` first). Only
collectives all three support are used: all_reduce SUM / MAX on int32 / fp32, all_gather.

Every collective is issued asynchronously and waited on with the group timeout, so a dead or
stuck peer turns into a ``TpError`` naming the operation and the layer instead of a hang.
"""

from __future__ import annotations

import datetime
import os

import torch

from h3quant import device_kinds
from h3quant.errors import TpError
from h3quant.runtime.tp.watchdog import bounded

BACKENDS = device_kinds.collectives()  # kind -> backend, from the device records
DEFAULT_TIMEOUT_S = 120.0


def backend_for(kind: str) -> str:
    """The torch.distributed backend for a device kind; TpError if TP cannot run there."""
    if kind not in BACKENDS:
        raise TpError(f"tensor parallel runs on {device_kinds.collective_help()}; device "
                      f"{kind!r} has no torch.distributed backend")
    return BACKENDS[kind]


def check_backend(name: str) -> None:
    """TpError with the reason when ``name`` cannot be used in this process."""
    import torch.distributed as dist

    if not dist.is_available():
        raise TpError("this torch build has no torch.distributed")
    if name == "gloo" and not dist.is_gloo_available():
        raise TpError("torch.distributed backend gloo is not available in this torch build")
    if name == "nccl" and not torch.cuda.is_available():
        raise TpError("torch.distributed backend nccl needs CUDA and an NCCL build of torch; "
                      "this torch sees no CUDA device")
    if name == "nccl" and not dist.is_nccl_available():
        raise TpError("torch.distributed backend nccl needs CUDA and an NCCL build of torch; "
                      f"this torch build ({torch.__version__}) has no NCCL")
    if name == "hccl":
        try:
            import torch_npu  # noqa: F401 (registers the hccl backend)
        except ImportError:
            raise TpError("torch.distributed backend hccl needs torch_npu, which is not "
                          "installed") from None
        if "hccl" not in dist.Backend.backend_list:
            raise TpError("torch_npu is installed but registered no hccl backend")


def init_group(backend: str, rank: int, world: int, timeout_s: float, *,
               addr: str | None = None, port: int | None = None) -> None:
    """``init_process_group`` from explicit coordinates (spawn) or the environment (torchrun)."""
    import torch.distributed as dist

    check_backend(backend)
    if addr is not None:
        os.environ["MASTER_ADDR"] = addr
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    where = (f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
             f"MASTER_PORT={os.environ.get('MASTER_PORT')}")
    stuck = (f"rank {rank}: cannot join the {backend} group of {world} within {timeout_s:g} s "
             f"({where}): no answer from the rendezvous -- a rank never joined, or something "
             "other than rank 0's store listens on MASTER_PORT")
    try:
        with bounded(stuck, timeout_s):
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise TpError(f"rank {rank}: cannot join the {backend} group of {world} "
                      f"({where}): {_first_line(exc)}") from None


def destroy_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with bounded(f"tearing down the process group took over {timeout_s:g} s", timeout_s):
            dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line.split(". This is typically")[0]  # gloo appends advice and an emoji


class Collectives:
    """all_reduce MAX / SUM and all_gather on the default group, each bounded by ``timeout_s``.

    ``_wire`` / ``_unwire`` convert to and from what the backend transports (identity here; the
    simulated NPU in ``h3quant.testing`` unwraps its tensors).
    """

    def __init__(self, rank: int, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.calls: list[str] = []

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def _unwire(self, wire: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return wire

    def _run(self, what: str, start) -> None:
        import torch.distributed as dist

        self.calls.append(what)
        stuck = (f"rank {self.rank}: {what} failed after at most {self.timeout_s:g} s (a peer "
                 "rank died, hung or diverged): no answer")
        try:
            with bounded(stuck, self.timeout_s):
                work = start(dist)
                if not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
                    raise RuntimeError(f"timed out after {self.timeout_s:g} s")
        except TpError:
            raise
        except Exception as exc:  # noqa: BLE001 (DistBackendError, RuntimeError...: a dead or stuck peer)
            raise TpError(f"rank {self.rank}: {what} failed after at most {self.timeout_s:g} s "
                          f"(a peer rank died, hung or diverged): {_first_line(exc)}") from None

    def all_reduce(self, t: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """In-place all_reduce of ``t`` with ``op`` in ("max", "sum"); returns ``t``."""
        if self.world == 1:
            return t
        wire = self._wire(t.contiguous())
        self._run(f"all_reduce({op.upper()}) of {what}",
                  lambda dist: dist.all_reduce(wire, op=getattr(dist.ReduceOp, op.upper()),
                                               async_op=True))
        return self._unwire(wire, t)

    def all_gather(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        if self.world == 1:
            return [t]
        wire = self._wire(t.contiguous())
        outs = [torch.empty_like(wire) for _ in range(self.world)]
        self._run(f"all_gather of {what}",
                  lambda dist: dist.all_gather(outs, wire, async_op=True))
        return [self._unwire(o, t) for o in outs]


class LocalCollectives(Collectives):
    """A group of one: every collective is the identity (the single-device reference run)."""

    def __init__(self) -> None:
        super().__init__(0, 1)
