"""nvfp4 with calibrated rounding: e2m1 codes, and the e4m3 block scales, chosen during error
feedback.

The uncalibrated encoder runs first and fixes the fp32 tensor scale ``t`` (``weight_scale_2``)
and, as a starting point, every e4m3 block scale ``s`` (``weight_scale``) exactly as rounding to
nearest (comfy-kitchen's quantizer) chooses them. A weight of block ``b`` takes one of the values
``e * t * s_b`` for the 15 e2m1 values ``e`` in [-6, 6] (what comfy-kitchen's dequantize
computes). ``calibration.feedback`` (``h3quant.calibration``) walks the columns in the plain
input basis, choosing each column's codes as the nearest such value (ties to even, as the
encoder rounds) after the error of the columns before it was fed forward.

Block scales are chosen when the sweep reaches a block's first column, from the block's 16
weights as the feedback has updated them (GPTQ's lazy group parameters): the encoder's own scale
for those values (``amax / 6 / t`` in e4m3) and its ``trial`` e4m3 neighbours on each side are
each tried, the block is rounded and fed back inside the block under each, and the feedback's
own loss ``sum_j (e_j / U_jj)^2`` picks one (``h3quant.formats.group_trial``). On real trained
weights this gained +1.0 to +1.6 dB a layer over scales fixed up front (docs/benchmarks.md).

A block the feedback has not changed (bit for bit) keeps the uncalibrated scale, and a block
whose scale is zero keeps code 0, so statistics that give no feedback (an identity Hessian)
reproduce the uncalibrated bytes exactly. The file is an ordinary nvfp4 file: comfy-kitchen
decodes any e4m3 block scale.
"""

from __future__ import annotations

import torch

from h3quant.formats.blocked import swizzle
from h3quant.formats.group_trial import group_loss
from h3quant.formats.nvfp4.tensors import (BLOCK, E2M1_MAX, E4M3_MAX, block_scales,
                                           encode_nvfp4, pack_hi_first, roundup, scaled_codes)

# e2m1 value of each 4-bit code (bit 3: sign), the decoder's table
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_LUT = _VALUES + tuple(-v for v in _VALUES)
TRIAL_ULPS = 1  # e4m3 neighbours on each side tried per block (2 measured no better end to end)
_E4M3_MAX_BITS = 0x7E  # 448, the largest finite e4m3 bit pattern


def rounded(v: torch.Tensor, total: torch.Tensor, lut: torch.Tensor):
    """(codes, values) of ``v`` under the block scales ``total = t * s`` (same shape): the
    encoder's fp32 arithmetic (``v / total`` clamped to +-6, nearest e2m1, ties to even); a zero
    scale gives code 0 (``scaled_codes``)."""
    code = scaled_codes(v, total)
    return code, lut[code.long()] * total


class _LazyBlocks:
    """One layer's block scales during the feedback: ``start`` (the group hook) and
    ``quantize`` (the per-column rounding)."""

    def __init__(self, x: torch.Tensor, t: torch.Tensor, grid: torch.Tensor, trial: int):
        n = x.shape[0]
        self.x, self.t, self.trial = x, t, trial
        self.grid = grid  # [Np, Kp/16] fp32 e4m3 values, rows >= n are padding (updated in place)
        self.plain = grid[:n].clone()
        self.total = t * grid[:n]
        self.lut = torch.tensor(E2M1_LUT, dtype=torch.float32)

    def start(self, cols: torch.Tensor, j: int, u: torch.Tensor) -> None:
        b, n = j // BLOCK, cols.shape[1]
        peak = torch.maximum(cols.amax(0), cols.amin(0).neg()).abs_()
        s8 = torch.clamp(peak / E2M1_MAX / self.t, max=E4M3_MAX).to(torch.float8_e4m3fn)
        if self.trial:
            offs = torch.arange(-self.trial, self.trial + 1)
            bits = s8.view(torch.uint8).to(torch.int64)
            cand = (bits.unsqueeze(0) + offs.unsqueeze(1)).clamp_(0, _E4M3_MAX_BITS)  # [C, n]
            scales = cand.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
            tot = self.t * scales
            loss = group_loss(cols, u, lambda v, jj: rounded(v, tot, self.lut)[1], len(offs))
            new = scales.gather(0, loss.argmin(0).unsqueeze(0)).squeeze(0)
        else:
            new = s8.to(torch.float32)
        same = (cols == self.x[:, j:j + BLOCK].t()).all(0)  # untouched rows keep their scale
        new = torch.where(same, self.plain[:, b], new)
        self.grid[:n, b] = new
        self.total[:, b] = self.t * new

    def quantize(self, v: torch.Tensor, j: int):
        return rounded(v, self.total[:, j // BLOCK], self.lut)


def encode_nvfp4_calibrated(w: torch.Tensor, calibration, *, lazy: bool = True,
                            trial: int = TRIAL_ULPS) -> dict[str, torch.Tensor]:
    """``encode_nvfp4``'s tensors with the e2m1 codes and the block scales re-chosen during
    ``calibration``'s feedback (``calibration.feedback(x, quantize, convrot=False)``, the plain
    basis; module text). ``lazy=False`` (or K not a multiple of 16): every block keeps the
    uncalibrated scale and only the codes move; ``trial``: the e4m3 neighbours on each side of
    the encoder's scale tried per block (0: the encoder's scale for the updated weights)."""
    out = encode_nvfp4(w)  # checks the weight; fixes the tensor scale and the first block scales
    n, k = w.shape
    np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
    t = out["weight_scale_2"].reshape(()).to(torch.float32)
    x = w.to(torch.float32)
    state = _LazyBlocks(x, t, block_scales(out["weight_scale"], np_, kp // BLOCK), trial)
    groups = (BLOCK, state.start) if lazy and k % BLOCK == 0 else None
    codes = calibration.feedback(x, state.quantize, convrot=False, groups=groups)
    full = torch.zeros((np_, kp), dtype=torch.uint8)  # padding rows and columns: code 0
    full[:n, :k] = codes
    out["weight"] = pack_hi_first(full)
    if groups is not None:  # e4m3 values: exact
        grid = state.grid.to(torch.float8_e4m3fn).view(torch.uint8)
        out["weight_scale"] = swizzle(grid).view(torch.float8_e4m3fn)
    return out


__all__ = ["E2M1_LUT", "TRIAL_ULPS", "encode_nvfp4_calibrated", "rounded"]
