"""Embeddings and the output head of the H3 forward (FORMATS.md 5.1), from float tensors.

- ``TimeEmbedding``: the pruned "curve" form (``adaln_t_table`` rows lerped at
  ``clamp(t, 0, 1) * (rows - 1)``, fp32, adaLN in fp32 without SiLU) or the full form
  (256-wide sinusoid, cos half then sin half, ``time_embedder.proj_in`` -> SiLU -> ``proj_out``
  in fp32; adaLN applies SiLU in the compute dtype);
- ``patchify_video`` / ``unpatchify_video`` (1x2x2 patches, channel-major, circular padding of
  odd H / W like the reference) and ``pack_audio`` / ``unpack_audio`` (stereo channel-major);
- ``FinalLayer``: RMSNorm, one (shift, scale) row per timestep, fp32 heads; a bank of heads is
  combined per sampler step (``schedule``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h3quant.errors import VerifyError
from h3quant.runtime.model.ops import rms_norm
from h3quant.runtime.model.schedule import AUDIO_SHIFT, VIDEO_SHIFT, HeadSpan

VIDEO_CHANNELS, AUDIO_CHANNELS = 24, 32
PATCH = (1, 2, 2)


@dataclass
class TimeEmbedding:
    table: torch.Tensor | None = None  # [rows, t] fp32 (curve form)
    proj_in: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, bias), full form
    proj_out: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def curve(self) -> bool:
        return self.table is not None

    @property
    def width(self) -> int:
        if self.table is not None:
            return int(self.table.shape[1])
        assert self.proj_out is not None  # the full form
        return int(self.proj_out[0].shape[0])

    def __call__(self, values, device=None) -> torch.Tensor:
        """[M, t] fp32 embeddings of the timesteps ``values`` (floats in [0, 1])."""
        if self.table is not None:  # the curve form
            table = self.table.to(device=device, dtype=torch.float32)
            rows = table.shape[0]
            if rows < 2:
                raise VerifyError(f"adaln_t_table has {rows} row(s); the lerp needs at least 2")
            t = torch.tensor(list(values), dtype=torch.float32, device=table.device)
            pos = t.clamp(0.0, 1.0) * (rows - 1)
            i0 = pos.floor().long().clamp(max=rows - 2)
            return torch.lerp(table[i0], table[i0 + 1], (pos - i0).unsqueeze(1))
        assert self.proj_in is not None and self.proj_out is not None  # the full form
        w_in, b_in = (p.to(device=device, dtype=torch.float32) for p in self.proj_in)
        w_out, b_out = (p.to(device=device, dtype=torch.float32) for p in self.proj_out)
        freq = w_in.shape[1]
        half = freq // 2
        t = torch.tensor(list(values), dtype=torch.float32, device=w_in.device)
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                              device=w_in.device) / half)
        args = t[:, None] * freqs[None]
        emb = torch.cat((torch.cos(args), torch.sin(args)), dim=-1)
        return F.linear(F.silu(F.linear(emb, w_in, b_in)), w_out, b_out)


def patchify_video(video: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[1, C, T, H, W] -> ([T * H/2 * W/2, C * 4] fp32 rows, padded (T, H, W)); odd H / W are
    padded circularly to the patch."""
    _, c, t, h, w = video.shape
    ph, pw = (-h) % PATCH[1], (-w) % PATCH[2]
    x = video.to(torch.float32)
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph, 0, 0), mode="circular")
    h2, w2 = (h + ph) // 2, (w + pw) // 2
    x = x.reshape(c, t, h2, 2, w2, 2).permute(1, 2, 4, 0, 3, 5)  # t, h, w, c, ph, pw
    return x.reshape(t * h2 * w2, c * 4), (t, h + ph, w + pw)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int, channels: int) -> torch.Tensor:
    """Inverse of ``patchify_video`` (padded sizes): [t*h/2*w/2, C*4] -> [1, C, t, h, w]."""
    x = rows.reshape(t, h // 2, w // 2, channels, 2, 2).permute(3, 0, 1, 4, 2, 5)
    return x.reshape(1, channels, t, h, w)


def pack_audio(audio: torch.Tensor) -> torch.Tensor:
    """[1, C, 2, Ta] -> [2 * Ta, C] fp32: channel 0's frames, then channel 1's."""
    _, c, ch, t = audio.shape
    return audio[0].to(torch.float32).permute(1, 2, 0).reshape(ch * t, c)


def unpack_audio(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    t = rows.shape[0] // channels
    return rows.reshape(channels, t, rows.shape[-1]).permute(2, 0, 1).unsqueeze(0)


@dataclass
class FinalLayer:
    norm: torch.Tensor  # [hidden]
    adaln_weight: torch.Tensor  # [2 * hidden, t]
    adaln_bias: torch.Tensor
    video_out: tuple[torch.Tensor, torch.Tensor]  # fp32 [n * Pv, hidden], [n * Pv]
    audio_out: tuple[torch.Tensor, torch.Tensor]
    video_patch: int
    audio_patch: int

    def shift_scale(self, t_emb: torch.Tensor, silu: bool, dtype: torch.dtype):
        t = F.silu(t_emb.to(dtype)) if silu else t_emb.to(dtype)
        mod = F.linear(t, self.adaln_weight.to(dtype), self.adaln_bias.to(dtype))
        return mod.chunk(2, dim=-1)  # shift, scale: [M, hidden]

    @property
    def bank(self) -> int:
        """How many heads ``video_out`` / ``audio_out`` stack (1: a plain head)."""
        return head_bank_size(self.video_out[0].shape[0], self.audio_out[0].shape[0],
                              self.video_patch, self.audio_patch)

    @staticmethod
    def head(weights: tuple[torch.Tensor, torch.Tensor], width: int):
        """Head 0 of a bank of ``rows / width`` heads (the whole head when there is one)."""
        w, b = weights
        if w.shape[0] % width:
            raise VerifyError(f"output head has {w.shape[0]} rows, not a multiple of {width}")
        return w[:width].to(torch.float32), b[:width].to(torch.float32)

    def __call__(self, x: torch.Tensor, t_emb: torch.Tensor, video: tuple[int, int, int],
                 audio: tuple[int, int, int], silu: bool, adaln_dtype: torch.dtype,
                 span: HeadSpan | None = None):
        """``video`` / ``audio``: (start, stop, timestep row). Returns fp32 (video, audio) rows.
        ``span``: the step's heads of a bank (``schedule.head_span``); needed when the layer
        holds more than one head, ignored otherwise."""
        n = self.bank
        if n > 1 and span is None:
            raise VerifyError(f"final_layer.video_out / audio_out hold a bank of {n} heads: the "
                              "forward needs the sampler's sigma schedule (sigmas=...)",
                              tensor="final_layer.video_out.weight")
        if span is not None and n > 1 and span.heads != n:
            raise VerifyError(f"the head span is for {span.heads} heads, the bank has {n}")
        shift, scale = self.shift_scale(t_emb, silu, adaln_dtype)
        outs = []
        for (a, b, row), weights, width, flow in ((video, self.video_out, self.video_patch,
                                                   VIDEO_SHIFT),
                                                  (audio, self.audio_out, self.audio_patch,
                                                   AUDIO_SHIFT)):
            h = rms_norm(x[a:b], self.norm)
            dt = torch.promote_types(h.dtype, scale.dtype)  # as the reference: no downcast
            h = (h.to(dt) * (1 + scale[row].to(dt)) + shift[row].to(dt)).to(torch.float32)
            head = self.head(weights, width) if n == 1 or span is None \
                else span.combine(*weights, width, flow)
            outs.append(F.linear(h, *head))
        return outs[0], outs[1]


def head_bank_size(video_rows: int, audio_rows: int, video_patch: int, audio_patch: int) -> int:
    """The number of stacked heads (``video_rows / video_patch``); VerifyError when the video
    and audio heads do not stack the same whole number of heads."""
    if video_rows % video_patch or audio_rows % audio_patch \
            or video_rows // video_patch != audio_rows // audio_patch or video_rows == 0:
        raise VerifyError(f"output heads hold {video_rows} video rows and {audio_rows} audio "
                          f"rows: not the same number n >= 1 of {video_patch}- and "
                          f"{audio_patch}-row heads", tensor="final_layer.video_out.weight")
    return video_rows // video_patch
