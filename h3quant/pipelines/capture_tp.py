"""``capture --tp N``: the calibration capture over N spawned CPU ranks (``runtime.tp``).

Every rank runs the streamed forward with its shard of each block (``TpH3Model``); rank 0's
recorders see every linear's whole input (out_proj's and fc2's slices all_gathered back into
their original column order: ``calibration.capture.Recording``) and write the statistics file,
staged by the caller like the single-process capture. Each rank keeps its own copy of the calls'
hidden states (within the memory budget, spilling beyond it to its own folder).
"""

from __future__ import annotations

from pathlib import Path

from h3quant.runtime.tp.group import DEFAULT_TIMEOUT_S
from h3quant.runtime.tp.launch import spawn_ranks


def capture_tp(tp: int, ckpt: str, calls: list, out, meta: dict, widths: dict[str, int], store,
               timeout_s: float | None = None) -> dict[str, int]:
    """Run ``calibration.capture.capture`` on ``tp`` ranks; returns rank 0's rows per layer.
    ``store``: the single-process store whose folder, call sizes and budget each rank copies."""
    spec = (str(store.folder), list(store.sizes), store.budget)
    return spawn_ranks(_rank_main, tp, (ckpt, calls, str(out), meta, widths, spec),
                       timeout_s=timeout_s or DEFAULT_TIMEOUT_S)


def _rank_main(ctx, ckpt, calls, out, meta, widths, spec):
    from h3quant.calibration.capture import capture
    from h3quant.calibration.hidden import HiddenStates, remove_empty
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.runtime.capabilities import live_probe
    from h3quant.runtime.devices import parse_device
    from h3quant.runtime.tp.model import TpH3Model

    folder, sizes, budget = spec
    store = HiddenStates(Path(folder) / f"rank{ctx.rank}", sizes, budget)
    store.clean()
    probe = live_probe()
    try:
        with Checkpoint(ckpt) as c:
            model = TpH3Model(c, device=parse_device(ctx.device, probe=probe), comm=ctx.comm,
                              mode="shared", probe=probe)
            return capture(model, calls, out, meta, widths, store=store, comm=ctx.comm)
    finally:
        store.close()
        remove_empty(store.folder)


__all__ = ["capture_tp"]
