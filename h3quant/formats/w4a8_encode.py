"""W4A8 encoder internals: the per-chunk encode of rotated rows, with a decoded-level table.

The final assignment (nearest DECODED level per weight under each candidate e4m3 group scale)
is the hot loop of the encoder. Decoded levels ``clamp(round(level * s), +-127)`` are integers
and the e4m3 scale has only 126 finite positive bit patterns, so for one level table everything
the assignment needs is a table indexed by (scale bits, half-unit bin of the target):

- ``t = w / s_channel`` is binned once per weight as ``q = floor(2 t)`` (clamped to 512 bins);
- the boundaries between consecutive decoded integers lie on multiples of 1/2, i.e. on bin
  edges, so every value in a bin has the same nearest decoded level (a value exactly on a
  boundary is equally far from both: same error);
- a candidate scale then costs one add and one table read per weight, instead of a nearest-level
  search, two decodes and a comparison.

The table is 126 x 512 entries (256 KB of fp32, cache-resident). The group error is summed in
the same fp32 order as before, so the scale chosen per group, the row scales and the decoded
int8 weights equal the previous encoder's; only the code chosen among codes that decode to the
same int8 value may differ (the decoded weight is the same).
"""

from __future__ import annotations

import torch

from h3quant.formats.w4a8_codebook import LevelIndex, als_group_scales, take

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_MAX_BITS = 0x7E  # largest finite e4m3fn bit pattern (448); 0x7F is NaN
_BINS = 512  # half-unit bins of t over [-128, 128)
_HALF_BINS = _BINS // 2


class DecodedLevels:
    """Nearest decoded level and its code for every (e4m3 scale bits, bin of ``2 t``)."""

    def __init__(self, table: torch.Tensor):
        table = table.float().cpu()
        bits = torch.arange(E4M3_MAX_BITS + 2, dtype=torch.uint8)
        s = bits.view(torch.float8_e4m3fn).float()
        s[-1] = 0.0  # 0x7F is NaN: never a candidate (bits are clamped to 1..0x7E)
        # exactly the decoder's arithmetic: fp32 product, round half to even, clamp
        dec = (table.unsqueeze(0) * s.unsqueeze(1)).round_().clamp_(-127, 127)  # [128, 16]
        # a bin centre (an odd multiple of 1/4) never lies on a midpoint between two decoded
        # integers, so the number of midpoints below it is the index of its nearest level (of
        # equal decoded levels, the last one when the centre lies above them, else the first)
        mids = ((dec[:, 1:] + dec[:, :-1]) * 0.5).contiguous()
        centre = (torch.arange(-_HALF_BINS, _HALF_BINS, dtype=torch.float32) * 2 + 1) / 4
        code = torch.searchsorted(mids, centre.expand(dec.shape[0], -1).contiguous())  # [128, 512]
        self.value = torch.gather(dec, 1, code).reshape(-1).contiguous().to(table.device)
        self.code = code.to(torch.int32).reshape(-1).contiguous().to(table.device)

    @staticmethod
    def bins(t: torch.Tensor) -> torch.Tensor:
        """int32 ``floor(2 t)`` clamped to [-256, 255] (``t`` finite)."""
        return t.mul(2.0).floor_().clamp_(-_HALF_BINS, _HALF_BINS - 1).to(torch.int32)

    @staticmethod
    def offsets(bits: torch.Tensor) -> torch.Tensor:
        """Table row offsets (int32) for scale bit patterns ``bits``."""
        return bits.to(torch.int32) * _BINS + _HALF_BINS


def search_order(search: int) -> list[int]:
    """Bit offsets tried per group, in order: 0, -1, +1, -2, +2, ... (first best wins)."""
    return [0] + [i for j in range(1, search + 1) for i in (-j, j)]


def encode_rows(x: torch.Tensor, index: LevelIndex, group_size: int, search: int,
                levels: DecodedLevels | None = None):
    """Rotated fp32 rows [n, K] -> (codes uint8 [n, K], s_rel e4m3 [n, K/G], s_channel f32 [n])."""
    if levels is None:
        levels = DecodedLevels(index.table)
    n, k = x.shape
    g = k // group_size
    gx = x.view(n, g, group_size)

    # 1. continuous group scales (nearest level + ALS) and each group's largest |level| * scale
    scale, zero, reach = als_group_scales(gx, index, codes=False)
    reach.masked_fill_(zero, 0.0)
    s_channel = reach.amax(dim=(1, 2)) / 127.0
    s_channel = torch.where(s_channel > 0, s_channel, torch.ones_like(s_channel))

    # 2. e4m3 relative scales, finite and positive (zero groups get the smallest one: decode 0)
    s_rel = (scale / s_channel.view(n, 1, 1)).masked_fill_(zero, 0.0)
    s_rel = s_rel.clamp_(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)

    # 3. per group, the scale among s_rel and its e4m3 neighbours (+-search ulps) whose nearest
    #    decoded levels reconstruct the group best; all candidates in one pass over the table
    target = gx / s_channel.view(n, 1, 1)
    q = DecodedLevels.bins(target)
    bits = s_rel.view(torch.uint8).to(torch.int32)  # [n, g, 1]
    cand = torch.cat([(bits + d).clamp_(1, E4M3_MAX_BITS) for d in search_order(search)], dim=2)
    off = DecodedLevels.offsets(cand)  # [n, g, C]
    idx = q.unsqueeze(2) + off.unsqueeze(3)  # [n, g, C, G]
    dec = take(levels.value, idx)
    err = dec.neg_().add_(target.unsqueeze(2)).square_().sum(-1)  # [n, g, C]
    pick = err.argmin(dim=2, keepdim=True)  # the first of equal errors, as in search_order
    best = torch.gather(cand, 2, pick)  # [n, g, 1]
    codes = take(levels.code, q.add_(DecodedLevels.offsets(best)))
    s_rel = best.to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.view(n, k).to(torch.uint8), s_rel.view(n, g).contiguous(), s_channel.contiguous()
