"""``capture --tp N``: the calibration capture over N ranks (``runtime.tp``): spawned here, or
torchrun's group, on CPUs (gloo), CUDA GPUs (nccl) or Ascend NPUs (hccl), one device per rank.

Every rank runs the streamed forward with its shard of each block (``TpH3Model``) on its own
device (``cuda:<local_rank>``); rank 0's recorders see every linear's whole input (out_proj's
and fc2's slices all_gathered back into their original column order:
``calibration.capture.Recording``), accumulate the statistics on rank 0's device in float32
(``sum |x|`` in float64), as the single-process capture does on that device, and write the
statistics file, staged by the caller like the single-process capture. Each rank keeps its own
copy of the calls' hidden states (within the memory budget, spilling beyond it to its own
folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3quant.runtime.tp.group import DEFAULT_TIMEOUT_S, Collectives
from h3quant.runtime.tp.launch import Launch, rank_setup_probe


@dataclass(frozen=True)
class TpHooks:
    """Tests and simulations only: the start method, a torch.distributed backend and
    collectives instead of the device's, and ``rank_setup(ctx)`` (a context manager giving
    ``(probe, device)`` inside each rank: ``runtime.tp.launch.rank_setup_probe``)."""

    start_method: str | None = None
    dist_backend: str | None = None
    comm_cls: Any = None
    rank_setup: Any = None


def capture_tp(launch: Launch, ckpt: str, calls: list, out, meta: dict, widths: dict[str, int],
               store, timeout_s: float | None = None,
               hooks: TpHooks | None = None) -> dict[str, int] | None:
    """Run ``calibration.capture.capture`` on ``launch``'s ranks; returns rank 0's rows per
    layer (None on torchrun's other ranks). ``store``: the single-process store whose folder,
    call sizes and budget each rank copies; ``out``: the staged file rank 0 writes."""
    hooks = hooks or TpHooks()
    spec = (str(store.folder), list(store.sizes), store.budget, hooks.rank_setup)
    return launch.run(_rank_main, (ckpt, calls, None if out is None else str(out), meta, widths,
                                   spec),
                      backend=hooks.dist_backend, timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
                      start_method=hooks.start_method, comm_cls=hooks.comm_cls or Collectives)


def _rank_main(ctx, ckpt, calls, out, meta, widths, spec):
    from h3quant.calibration.capture import capture
    from h3quant.calibration.hidden import HiddenStates, remove_empty
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.runtime.capabilities import live_probe
    from h3quant.runtime.devices import parse_device
    from h3quant.runtime.tp.model import TpH3Model

    folder, sizes, budget, rank_setup = spec
    store = HiddenStates(Path(folder) / f"rank{ctx.rank}", sizes, budget)
    store.clean()
    try:
        with rank_setup_probe(ctx, rank_setup) as probe, Checkpoint(ckpt) as c:
            probe = probe or live_probe()
            model = TpH3Model(c, device=parse_device(ctx.device, probe=probe), comm=ctx.comm,
                              mode="shared", probe=probe)
            return capture(model, calls, out, meta, widths, store=store, comm=ctx.comm)
    finally:
        store.close()
        remove_empty(store.folder)


__all__ = ["TpHooks", "capture_tp"]
