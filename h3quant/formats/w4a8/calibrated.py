"""W4A8 with calibrated rounding: the codebook and row scales of ``encode_w4a8``, group scales
and codes chosen during error feedback.

The uncalibrated encoder runs first and fixes the 16-level codebook and the fp32 row scales.
``calibration.feedback`` (``h3quant.calibration``) then sweeps the ConvRot-basis columns with
error feedback. When the sweep reaches a group's first column, the group's e4m3 scale is chosen
from the group's weights as the feedback has updated them so far (GPTQ's lazy group parameters;
a scale fixed up front from the original weights fits weights the feedback has since moved):

the uncalibrated encoder's own choice for those 16 values (ALS scale, then the e4m3 scale of
its neighbours whose nearest levels reconstruct the group best). With ``trial`` > 0, that scale
and its ``trial`` e4m3 neighbours on each side are each tried: the group's 16 columns are
quantized and fed back inside the group for every candidate, and the feedback's own loss
``sum_j (e_j / U_jj)^2`` (``U`` the inverse Hessian's factor) decides. On real weights the
trial gained about +0.1 dB a layer but nothing end to end, so it is off by default.

Each weight's candidate values are the 16 decoded levels of its group,
``clamp(round(level * s_rel), -127, 127) * s_channel`` (exactly what the decoder and the runtime
compute). A group the feedback has not changed (bit for bit) keeps the uncalibrated scale, and
where the nearest candidate is as close as the uncalibrated code's value that code is kept, so
statistics that give no feedback (an identity Hessian) reproduce the uncalibrated bytes exactly.
"""

from __future__ import annotations

import torch

from h3quant.convrot import rotate
from h3quant.formats.group_trial import group_loss
from h3quant.formats.w4a8.codebook import ALS_PASSES, LevelIndex, decoded_levels
from h3quant.formats.w4a8.encoder import (E4M3_MAX_BITS, DecodedLevels, continuous_scales,
                                          scales_and_codes)
from h3quant.formats.w4a8.tensors import (SCALE_SEARCH_ULPS, encode_w4a8, pack_nibbles,
                                          unpack_nibbles)

TRIAL_ULPS = 0  # e4m3 neighbours on each side tried in the feedback (2 measured no better end to end)


def nearest(t: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of ``lv`` [..., 16] for every value of ``t`` [...] (the first of
    equally near ones)."""
    return (t.unsqueeze(-1) - lv).abs_().argmin(-1)  # (min(dim) was 1000x slower on 2 threads)


def trial_loss(t: torch.Tensor, lv: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Error feedback's loss ``sum_j (e_j / u_jj)^2`` of one group under each candidate scale:
    ``t`` [G, n] the group's values (in row-scale units), ``lv`` [C, n, 16] the candidates'
    levels, ``u`` [G, G] the group's block of the inverse Hessian's factor. Returns [C, n]."""
    def rounding(v: torch.Tensor, jj: int) -> torch.Tensor:
        return lv.gather(2, nearest(v, lv).unsqueeze(2)).squeeze(2)

    return group_loss(t, u, rounding, lv.shape[0])


class _LazyScales:
    """The per-group state of one layer's feedback: current scales and levels, ``start`` (the
    feedback's group hook) and ``quantize`` (its per-column rounding)."""

    def __init__(self, rot, out, group_size: int, trial: int):
        self.rot, self.g, self.trial = rot, group_size, trial
        self.s_ch = out["weight_s_channel"].float()
        self.table = out["weight_codebook"].float()
        self.plain = out["weight_s_rel"].float()  # [n, K / G], e4m3 as the encoder wrote it
        self.s_rel = self.plain.clone()
        self.levels = decoded_levels(self.table, self.s_rel)  # [n, K / G, 16]
        self.rtn = unpack_nibbles(out["weight"]).to(torch.int64)  # [n, K]
        self.index, self.dl = LevelIndex(self.table), DecodedLevels(self.table)

    def start(self, cols: torch.Tensor, j: int, u: torch.Tensor) -> None:
        gi, xt = j // self.g, cols.contiguous()  # [G, n]: the group's updated columns
        scale, zero, _, _ = continuous_scales(xt, self.index, self.dl, ALS_PASSES)
        _, sr = scales_and_codes(xt, scale, zero, self.s_ch, self.dl, SCALE_SEARCH_ULPS)
        if self.trial:
            offs = torch.arange(-self.trial, self.trial + 1, device=xt.device)
            bits = sr.view(torch.uint8).to(torch.int64)
            cand = (bits.unsqueeze(0) + offs.unsqueeze(1)).clamp_(1, E4M3_MAX_BITS)  # [C, n]
            scales = cand.to(torch.uint8).view(torch.float8_e4m3fn).float()
            loss = trial_loss(xt / self.s_ch, decoded_levels(self.table, scales), u)
            new = scales.gather(0, loss.argmin(0).unsqueeze(0)).squeeze(0)
        else:
            new = sr.float()
        same = (xt == self.rot[:, j:j + self.g].t()).all(0)  # untouched rows keep their scale
        new = torch.where(same, self.plain[:, gi], new)
        self.s_rel[:, gi] = new
        self.levels[:, gi] = decoded_levels(self.table, new)

    def quantize(self, v: torch.Tensor, j: int):
        t = v / self.s_ch
        lv = self.levels[:, j // self.g, :]  # [n, 16]
        dist = (t.unsqueeze(1) - lv).abs_()
        idx = dist.argmin(1)
        best = dist.gather(1, idx.unsqueeze(1)).squeeze(1)
        keep = dist.gather(1, self.rtn[:, j:j + 1]).squeeze(1) <= best
        code = torch.where(keep, self.rtn[:, j], idx)
        return code, lv.gather(1, code.unsqueeze(1)).squeeze(1) * self.s_ch


def encode_w4a8_calibrated(weight: torch.Tensor, calibration, *, group_size: int = 16,
                           convrot_groupsize: int = 256, codebook: str = "auto",
                           pool=None, lazy: bool = True, trial: int = TRIAL_ULPS
                           ) -> dict[str, torch.Tensor]:
    """``encode_w4a8``'s tensors with the group scales and codes re-chosen during
    ``calibration``'s feedback (module text). ``lazy=False``: every group keeps the
    uncalibrated scale (only the codes move); ``trial``: the e4m3 neighbours on each side
    tried in the feedback (0: the encoder's choice for the updated weights)."""
    out = encode_w4a8(weight, group_size=group_size, convrot_groupsize=convrot_groupsize,
                      codebook=codebook, pool=pool)
    n, k = weight.shape
    state = _LazyScales(rotate(weight.float(), convrot_groupsize), out, group_size, trial)
    groups = (group_size, state.start) if lazy else None
    codes = calibration.feedback(state.rot, state.quantize, convrot=True,
                                 group_size=convrot_groupsize, groups=groups)
    out["weight"] = pack_nibbles(codes).reshape(n, k // 2)
    out["weight_s_rel"] = state.s_rel.to(torch.float8_e4m3fn)  # e4m3 values: exact
    return out


__all__ = ["TRIAL_ULPS", "encode_w4a8_calibrated", "nearest", "trial_loss"]
