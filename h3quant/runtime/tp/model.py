"""The whole H3 forward with tensor-parallel DiT blocks.

``TpH3Model`` is the runtime's streaming ``H3Model`` with one change: each DiT block is built
as this rank's shard (``shard_block``: its heads, its fc1 slice, its K slices of out_proj / fc2,
only its bytes read). Embeddings, the token refiner and the final layer are small and run
replicated on every rank; block outputs come back reduced, so every rank holds the same hidden
state between blocks and the same final outputs.
"""

from __future__ import annotations

import torch

from h3quant.formats.checkpoint import Checkpoint
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


def model_inputs(model: H3Model, seed: int, dtype: torch.dtype, *, frames: int = 2,
                 height: int = 4, width: int = 4, audio_len: int = 4, text_len: int = 8):
    """Seeded (video, audio, text) latents of a small t2va call: the same values on every rank
    and every device (a CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, model.video_channels, frames, height, width, generator=g)
    audio = torch.randn(1, model.audio_channels, 2, audio_len, generator=g)
    text = torch.randn(1, text_len, model.text_dim, generator=g)
    return video.to(dtype), audio.to(dtype), text.to(dtype)
