"""The reference side of a card, computed once and reused for every file: its hidden state
before and after every block (spilled to a temporary file, so memory stays flat in the number
of blocks and files), its outputs and its sampling trajectory (the latents after every step)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from h3quant.pipelines.compare.sampler import euler


@dataclass(frozen=True)
class Dims:
    hidden: int
    blocks: tuple[int, ...]
    text_dim: int
    video_channels: int
    audio_channels: int
    head_bank: int

    @classmethod
    def of(cls, model) -> "Dims":
        return cls(model.hidden, tuple(model.blocks), model.text_dim, model.video_channels,
                   model.audio_channels, model.head_bank)


class ReferenceRun:
    """Run the reference (CPU, fp32) once; ``state(k)`` is the hidden state entering block
    ``blocks[k]`` (``k = len(blocks)``: after the last block)."""

    def __init__(self, model, inputs, sched, workdir: str, *, bar=None):
        self.dims = Dims.of(model)
        video, audio, text = inputs.tensors(self.dims.video_channels, self.dims.audio_channels,
                                            self.dims.text_dim)
        self._path = os.path.join(workdir, "reference_states.f32")
        self._fh = open(self._path, "w+b")
        t0 = time.perf_counter()
        st = model.start(video, audio, text, inputs.sigma, sigmas=sched)
        self.rows = int(st.x.shape[0])
        self._put(0, st.x)
        for k, i in enumerate(self.dims.blocks):
            model.run_block(st, i)
            self._put(k + 1, st.x)
            if bar is not None:
                bar.update(1)
        self.outputs = tuple(o.float().cpu() for o in model.finish(st))
        self.forward_seconds = time.perf_counter() - t0
        del st
        self.trajectory: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.step_seconds: list[float] = []
        self.heads: list[list[int] | None] = []
        self.sched = sched
        if sched is not None:
            def on_step(i, xv, xa, seconds):
                self.trajectory.append((xv.clone(), xa.clone()))
                self.step_seconds.append(seconds)
                if bar is not None:
                    bar.update(1)

            euler(model, video, audio, text, sched, torch.float32, on_step)
            for i, s in enumerate(sched[:-1]):
                span = model.head_for(s, sched)
                self.heads.append(None if span is None else [span.start, span.stop])

    def _put(self, k: int, x: torch.Tensor) -> None:
        a = x.detach().float().cpu().contiguous().numpy()
        self._fh.seek(k * a.nbytes)
        self._fh.write(a.tobytes())

    def state(self, k: int) -> torch.Tensor:
        n = self.rows * self.dims.hidden
        self._fh.flush()
        self._fh.seek(k * n * 4)
        a = np.frombuffer(self._fh.read(n * 4), dtype=np.float32, count=n)
        return torch.from_numpy(a.copy()).reshape(self.rows, self.dims.hidden)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        try:
            os.unlink(self._path)
        except OSError:
            pass
