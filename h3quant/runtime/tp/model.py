"""The whole H3 forward with tensor-parallel DiT blocks.

``TpH3Model`` is the runtime's streaming ``H3Model`` with one change: each DiT block is built
as this rank's shard (``shard_block``: its heads, its fc1 slice, its K slices of out_proj / fc2,
only its bytes read). Embeddings, the token refiner and the final layer are small and run
replicated on every rank; block outputs come back reduced, so every rank holds the same hidden
state between blocks and the same final outputs.
"""

from __future__ import annotations

import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.runtime.model.model import H3Model
from h3quant.runtime.tp.group import Collectives
from h3quant.runtime.tp.runner import ShardInfo, held_bytes, shard_block


class TpH3Model(H3Model):
    """``H3Model`` whose DiT blocks are this rank's shards (see the module docstring)."""

    def __init__(self, ckpt: Checkpoint, *, device, comm: Collectives, mode: str,
                 backend: str | None = None, probe=None) -> None:
        super().__init__(ckpt, device=device, linear="runtime", backend=backend, probe=probe)
        self.comm, self.mode = comm, mode
        self.infos: list[ShardInfo] = []
        self.held = 0  # bytes the largest sharded block's linears held

    def load_block(self, index: int, dtype: torch.dtype):
        prefix = f"{self.prefix}blocks.{index}"
        block, info = shard_block(self.ckpt, self.scan, prefix, index, self.comm, mode=self.mode,
                                  device=self.device, probe=self.probe, backend=self.backend,
                                  compute_dtype=dtype)
        self.infos.append(info)
        self.held = max(self.held, held_bytes(block))
        return block

