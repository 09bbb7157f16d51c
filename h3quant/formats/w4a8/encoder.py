"""W4A8 encoder internals: the per-chunk encode of rotated rows, with a decoded-level table.

The final assignment (nearest DECODED level per weight under each candidate e4m3 group scale)
is the hot loop of the encoder. Decoded levels ``clamp(round(level * s), +-127)`` are integers
and the e4m3 scale has only 126 finite positive bit patterns, so for one level table everything
the assignment needs is a table indexed by (scale bits, half-unit bin of the target):

- ``t = w / s_channel`` is binned once per weight as ``q = floor(2 t)`` (clamped to 512 bins);
- the boundaries between consecutive decoded integers lie on multiples of 1/2, i.e. on bin
  edges, so every value in a bin has the same nearest decoded level (a value exactly on a
  boundary is equally far from both: same error);
- a candidate scale then costs one table read per weight, instead of a nearest-level search,
  two decodes and a comparison.

The table is 512 x 128 entries (rows ``bin * 128 + bits``); ``DecodedLevels.window`` turns it
into a table of the C candidate offsets' levels per row (the scale-bit clamp baked in), packed
as int8 bytes eight to an int64 word, so the candidates of a weight are one gather per word.
The ALS rounds read the nearest level VALUE from a fine grid over [-1, 1] (``FineLevels``) and
redo exactly the few groups that touch a cell holding a level midpoint. Chunks are processed
group-major (``[G, groups]``) so per-group sums are contiguous row adds, in the same rounding
order as the reference's ``sum(-1)``.

The scale chosen per group, the row scales and the decoded int8 weights equal the previous
(row-major, search-based) encoder's; only the code chosen among codes that decode to the same
int8 value may differ (the decoded weight is the same).
"""

from __future__ import annotations

import torch

from h3quant.errors import FormatError
from h3quant.formats.w4a8.codebook import ALS_PASSES, LevelIndex, decoded_levels, take

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_MAX_BITS = 0x7E  # largest finite e4m3fn bit pattern (448); 0x7F is NaN
_BINS = 512  # half-unit bins of t over [-128, 128)
_HALF_BINS = _BINS // 2
_ROWS = E4M3_MAX_BITS + 2  # e4m3 bit patterns 0..0x7F
_TINY = torch.finfo(torch.float32).tiny
_F_CAP = 2.0**100  # cell factor cap: x * f stays finite (|x| < 2**27 after the checks)


class DecodedLevels:
    """Nearest decoded level and its code for every (e4m3 scale bits, bin of ``2 t``)."""

    def __init__(self, table: torch.Tensor):
        table = table.float().cpu()
        bits = torch.arange(_ROWS, dtype=torch.uint8)
        s = bits.view(torch.float8_e4m3fn).float()
        s[-1] = 0.0  # 0x7F is NaN: never a candidate (bits are clamped to 1..0x7E)
        # exactly the decoder's arithmetic: fp32 product, round half to even, clamp
        dec = decoded_levels(table, s)  # [128, 16]
        # a bin centre (an odd multiple of 1/4) never lies on a midpoint between two decoded
        # integers, so the number of midpoints below it is the index of its nearest level (of
        # equal decoded levels, the last one when the centre lies above them, else the first)
        mids = ((dec[:, 1:] + dec[:, :-1]) * 0.5).contiguous()
        centre = (torch.arange(-_HALF_BINS, _HALF_BINS, dtype=torch.float32) * 2 + 1) / 4
        code = torch.searchsorted(mids, centre.expand(dec.shape[0], -1).contiguous())  # [128, 512]
        value = torch.gather(dec, 1, code)  # [128, 512]
        # stored bin-major ([512, 128]): the candidate scales of one weight are neighbours
        self.value = value.t().reshape(-1).contiguous().to(table.device)
        self.code = code.to(torch.int32).t().reshape(-1).contiguous().to(table.device)
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def window(self, search: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate tables of ``search``: ``(levels, codes)``.

        For row ``r = bin * 128 + bits`` and the ``j``-th offset ``d`` of
        ``search_order(search)`` (``C`` of them): the nearest decoded level under the scale bits
        ``clamp(bits + d, 1, 0x7E)`` (the clamp baked in) and its code. ``levels``: int64
        ``[W, rows]`` holding the ``C`` levels of a row as int8 bytes, eight per word (decoded
        levels are integers in [-127, 127]), so one gather per word fetches eight candidates;
        candidate ``j`` is byte ``j % 8`` of word ``j // 8`` (``gather_candidates``).
        ``codes``: uint8 ``[rows * C]``, candidate ``j`` of row ``r`` at ``r * C + j``.
        """
        if search not in self._windows:
            d = torch.tensor(search_order(search), dtype=torch.int64)
            c = d.numel()
            bits = torch.arange(_ROWS, dtype=torch.int64)
            cols = (bits.unsqueeze(1) + d).clamp_(1, E4M3_MAX_BITS)  # [128, C]
            rows = (torch.arange(_BINS, dtype=torch.int64) * _ROWS).view(-1, 1, 1) + cols
            idx = rows.view(-1).to(self.value.device)
            lv = self.value.index_select(0, idx).view(-1, c).to(torch.int8)  # [rows, C]
            words = -(-c // 8)
            packed = torch.zeros(lv.shape[0], words * 8, dtype=torch.int8, device=lv.device)
            packed[:, :c] = lv
            lv = packed.view(torch.int64).t().contiguous()  # [W, rows]
            codes = self.code.index_select(0, idx).to(torch.uint8).contiguous()
            self._windows[search] = (lv, codes)
        return self._windows[search]

    def fine(self, index: LevelIndex) -> FineLevels:
        if getattr(self, "_fine", None) is None:
            self._fine = FineLevels(index)
        return self._fine

    @staticmethod
    def rows(t: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """Table row of each weight: ``(floor(2 t) + 256) * 128 + bits`` (int32, ``t`` [G, m]
        finite, ``bits`` [m] its group's e4m3 scale bits), ``floor(2 t)`` clamped to [-256, 255]."""
        q = t.mul(2.0).floor_().clamp_(-_HALF_BINS, _HALF_BINS - 1).to(torch.int32)
        return torch.add(bits.to(torch.int32).add_(_HALF_BINS * _ROWS), q, alpha=_ROWS)


class FineLevels:
    """The nearest level VALUE of ``u = x / scale`` in one table read, for the ALS rounds.

    A grid of ``bins`` cells over [-1, 1] (values beyond land in the end cells): a cell whose
    range, widened by a guard margin for the fp32 rounding of the cell index, holds no midpoint
    between levels stores its level; the few cells that do hold one store NaN, which makes the
    group's sums NaN, and those groups are redone with the exact search (``LevelIndex``).
    """

    def __init__(self, index: LevelIndex, bins: int = 1 << 16):
        self.index = index
        self.bins = bins
        self._mids = index.mids_ext[:-1].contiguous()  # fp32, as LevelIndex.nearest compares
        table = index.table
        mids = ((table[1:].double() + table[:-1].double()) * 0.5)
        edges = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)
        margin = 0.125 * 2.0 / bins
        lo, hi = edges[:-1] - margin, edges[1:] + margin
        lo[0], hi[-1] = -float("inf"), float("inf")
        a, b = torch.searchsorted(mids, lo), torch.searchsorted(mids, hi)
        lut = table[a.clamp(max=15)].clone()
        lut[a != b] = float("nan")
        # end cells repeated ``pad`` times on each side (one more at the top, for u = 1.25):
        # values within +-REACH land in them without a clamp
        pad = bins // 8
        self.lut = torch.cat([lut[:1].expand(pad), lut, lut[-1:].expand(pad + 1)]).float().contiguous()
        self._offset = torch.tensor(bins * 0.5 + pad, dtype=torch.float32)

    REACH = 1.25  # |x / scale| up to which the padded table needs no clamp

    def levels(self, xt: torch.Tensor, scale: torch.Tensor, reach: float = float("inf")) -> torch.Tensor:
        """Level values for ``xt / scale`` ([G, m] / [m]); NaN where a cell is ambiguous.

        The cell index is ``x * (half / scale) + half + pad``: a few ulps from the exact
        ``x / scale * half + half + pad``, far inside the guard margin; the factor is capped so
        that it stays finite. ``reach``: a bound on ``|x / scale|``; at most ``REACH``, the
        cells need no clamp (the end cells' copies hold the values beyond [-1, 1]).
        """
        half = self.bins * 0.5
        f = torch.reciprocal(scale).mul_(half).clamp_(max=_F_CAP)
        cell = torch.addcmul(self._offset, xt, f)
        if not reach <= self.REACH:
            cell.clamp_(0, self.lut.numel() - 1)
        return take(self.lut, cell.to(torch.int32))

    def fix_ambiguous(self, xt, scale, num, den) -> None:
        """Redo, exactly, the groups whose sums met an ambiguous cell (NaN)."""
        bad = torch.isnan(num).nonzero().view(-1)
        if bad.numel():
            x = xt.index_select(1, bad)
            # the number of midpoints below each value (ties to the lower level): the index's
            # nearest level, as one binary search over the fp32 midpoints
            lv = take(self.index.table, torch.bucketize(x / scale[bad], self._mids, out_int32=True))
            sums = _group_sum(torch.stack([lv * x, lv.mul_(lv)]))  # [2, bad]
            num.index_copy_(0, bad, sums[0])
            den.index_copy_(0, bad, sums[1])


def gather_candidates(cand: torch.Tensor, c: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[C, *rows.shape]``: the ``C`` candidate decoded levels of every table row in
    ``rows`` (``cand`` from ``DecodedLevels.window``). One int64 gather fetches eight candidates;
    the strided int8 bytes are then converted straight into their candidate-major places (one
    copy per word: much faster than a gather per candidate plus a conversion)."""
    flat = rows.reshape(-1)
    out = torch.empty(c, flat.numel(), dtype=torch.float32, device=rows.device)
    for w in range(cand.shape[0]):
        got = torch.index_select(cand[w], 0, flat).view(torch.int8).view(-1, 8)
        j = min(8, c - 8 * w)
        out[8 * w:8 * w + j].copy_(got[:, :j].t())
    return out.view(c, *rows.shape)


def _squared_diff(target: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    """``(target - dec) ** 2`` into ``dec`` (``target`` broadcast over the candidates): mse_loss's
    unreduced kernel computes ``d = a - b; d * d`` in one pass, the same two roundings as a
    subtraction then a square (one-time self-check, else the two passes)."""
    if _mse_ok():
        # torch's stubs type only the Python wrapper (reduction by name, no out=); the native
        # function takes the reduction enum and out=
        return torch._C._nn.mse_loss(dec, target.expand_as(dec), 0, out=dec)  # type: ignore[call-arg, arg-type]
    return torch.sub(target, dec, out=dec).square_()


_MSE_OK: list[bool] = []


def _mse_ok() -> bool:
    if not _MSE_OK:
        gen = torch.Generator().manual_seed(3)
        a = torch.randn(3, 4096, generator=gen) * torch.exp(torch.randn(3, 4096, generator=gen) * 4)
        b = torch.randn(4096, generator=gen).mul_(50).round_()
        try:
            got = torch._C._nn.mse_loss(a.clone(), b.expand_as(a), 0,  # type: ignore[call-arg, arg-type]
                                        out=torch.empty_like(a))  # (native signature, as above)
        except (AttributeError, RuntimeError, TypeError):
            got = None
        _MSE_OK.append(got is not None and torch.equal(got, (b - a).square()))
    return _MSE_OK[0]


def search_order(search: int) -> list[int]:
    """Bit offsets tried per group, in order: 0, -1, +1, -2, +2, ... (first best wins)."""
    return [0] + [i for j in range(1, search + 1) for i in (-j, j)]


_SUM_ORDER_OK: dict[int, bool] = {}


def _group_sum(v: torch.Tensor, *, clobber: bool = False) -> torch.Tensor:
    """Sum over dim -2 of a group-major ``[..., G, M]`` tensor, rounded like ``sum(-1)`` of the
    row-major ``[M, G]`` layout (the reference encoder's order), so both choose the same scales.

    For G = 16 torch's vectorised inner reduction adds the two halves, then the eight partial
    sums in order; that order is reproduced with contiguous row adds (much faster than a
    reduction over 16 contiguous values) after a one-time self-check, else (and for a few
    columns, where the number of ops dominates) a transpose + ``sum(-1)``, the reference itself.
    ``clobber``: ``v`` is a temporary; the sums are made in its memory (the result may view it).
    """
    g = v.shape[-2]
    if g == 16 and v.shape[-1] >= 256 and _sum_order_ok(g):
        if clobber:  # the same adds in the same order, written over ``v`` (no new tensors)
            a = v[..., :8, :].add_(v[..., 8:, :])
            out = a[..., 0, :].add_(a[..., 1, :])
        else:
            a = v[..., :8, :] + v[..., 8:, :]
            out = a[..., 0, :] + a[..., 1, :]
        for j in range(2, 8):
            out.add_(a[..., j, :])
        return out
    return v.transpose(-1, -2).contiguous().sum(-1)


def _sum_order_ok(g: int) -> bool:
    if g not in _SUM_ORDER_OK:
        gen = torch.Generator().manual_seed(g)
        x = torch.randn(4096, g, generator=gen) * torch.exp(torch.randn(4096, g, generator=gen) * 3)
        a = x.t()[:8] + x.t()[8:]
        got = a[0] + a[1]
        for j in range(2, 8):
            got = got + a[j]
        _SUM_ORDER_OK[g] = torch.equal(got, x.sum(-1))
    return _SUM_ORDER_OK[g]


def continuous_scales(xt: torch.Tensor, index: LevelIndex, levels: DecodedLevels,
                      passes: int = ALS_PASSES, *, rows: tuple[int, int] | None = None,
                      n: int | None = None):
    """Step 1 of the encoder: the continuous scale of every group of ``xt`` [G, m] (nearest
    level of the abs-max-normalised group, then ALS rounds: scale = <x, l> / <l, l>, reassign).
    Returns (scale [m], zero-group mask [m], group minima [m], group maxima [m]); a NaN or inf
    raises ``FormatError`` naming ``rows`` (of ``n`` rows, for the message)."""
    lo, hi = xt.amin(0), xt.amax(0)
    absmax = torch.maximum(lo.neg(), hi)  # NaN or inf anywhere in a group makes it non-finite
    if not bool(torch.isfinite(absmax).all()):  # (amin, amax and maximum propagate NaN)
        r0, r1 = rows if rows is not None else (0, (n or 1) - 1)
        raise FormatError(f"W4A8 weight holds NaN or inf (rows {r0}..{r1})")
    zero = absmax == 0
    scale = absmax.masked_fill(zero, 1.0)
    fine = levels.fine(index)
    for p in range(passes):
        # |x / scale| <= 1 in the first round (scale = the group's abs-max), else measured
        limit = 1.0 if p == 0 else float((absmax / scale).amax())
        lv = fine.levels(xt, scale, limit)
        num = _group_sum(lv * xt, clobber=True)
        den = _group_sum(lv.mul_(lv), clobber=True)
        fine.fix_ambiguous(xt, scale, num, den)
        new = num.div_(den.clamp_(min=_TINY))
        scale = torch.where((new > 0) & ~zero, new, scale)
    return scale, zero, lo, hi


def scales_and_codes(xt: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     s_ch_g: torch.Tensor, levels: DecodedLevels, search: int):
    """Steps 2 and 3 of the encoder, the row scales given (``s_ch_g`` [m], each group's):
    (codes uint8 [G, m], e4m3 group scales [m]).

    2. e4m3 relative scales ``scale / s_ch``, finite and positive (zero groups get the smallest
       one: decode 0); 3. per group, the scale among them and their e4m3 neighbours (+-search
    ulps) whose nearest decoded levels reconstruct the group best (the first best in search
    order), and those levels' codes."""
    m = xt.shape[1]
    s_rel = (scale / s_ch_g).masked_fill_(zero, 0.0)
    bits = s_rel.clamp_(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    target = xt / s_ch_g
    base = DecodedLevels.rows(target, bits)  # [G, m]: table rows
    cand, codes_w = levels.window(search)
    offsets = search_order(search)
    c = len(offsets)
    dec = gather_candidates(cand, c, base)  # [C, G, m]
    err = _group_sum(_squared_diff(target, dec), clobber=True)  # [C, m]
    best_err, pick = err[0], torch.zeros(m, dtype=torch.int32, device=xt.device)
    for j in range(1, c):  # the first best wins (strict <), as in search order
        better = err[j] < best_err
        best_err = torch.minimum(best_err, err[j])
        pick.masked_fill_(better, j)
    shift = torch.tensor(offsets, dtype=torch.int32, device=xt.device)
    best = take(shift, pick).add_(bits.to(torch.int32)).clamp_(1, E4M3_MAX_BITS)
    codes = take(codes_w, base.mul_(c).add_(pick))  # [G, m] uint8
    return codes, best.to(torch.uint8).view(torch.float8_e4m3fn)


def encode_rows(x: torch.Tensor, index: LevelIndex, group_size: int, search: int,
                levels: DecodedLevels | None = None, passes: int = ALS_PASSES, *,
                pack: bool = False, rows: tuple[int, int] | None = None):
    """Rotated fp32 rows [n, K] -> (codes uint8 [n, K], s_rel e4m3 [n, K/G], s_channel f32 [n]).

    ``pack``: return the codes packed two per byte (int8 [n, K/2], ``pack_nibbles``'s layout;
    needs an even ``group_size``). A NaN or inf in ``x`` raises ``FormatError`` naming ``rows``
    (the chunk's first and last row in the layer, for the message).
    """
    n, k = x.shape
    xt = x.reshape(n * k // group_size, group_size).t().contiguous()
    return encode_groups(xt, n, index, search, levels, passes, pack=pack, rows=rows)


def encode_groups(xt: torch.Tensor, n: int, index: LevelIndex, search: int,
                  levels: DecodedLevels | None = None, passes: int = ALS_PASSES, *,
                  pack: bool = False, rows: tuple[int, int] | None = None):
    """``encode_rows`` of rows given group-major: ``xt`` [G, n * K / G] (``rotate_group_major``).

    Works group-major: per-group sums and maxima become adds of contiguous rows and per-group
    scalars broadcast along rows.
    """
    if levels is None:
        levels = DecodedLevels(index.table)
    group_size, m = xt.shape
    g = m // n
    k = g * group_size
    table = index.table

    scale, zero, lo, hi = continuous_scales(xt, index, levels, passes, rows=rows, n=n)
    ends = table.index_select(0, index.nearest(torch.stack([lo / scale, hi / scale])).view(-1))
    reach = ends.view(2, m).abs_().amax(0).mul_(scale).masked_fill_(zero, 0.0)
    s_channel = reach.view(n, g).amax(1) / 127.0
    s_channel = torch.where(s_channel > 0, s_channel, torch.ones_like(s_channel))
    s_ch_g = s_channel.repeat_interleave(g)  # per group
    codes, s_rel = scales_and_codes(xt, scale, zero, s_ch_g, levels, search)
    if pack:
        high = codes[1::2].mul_(16).add_(codes[0::2])  # in place: byte = even | odd << 4
        packed = high.t().contiguous()  # [m, G/2]
        return packed.view(torch.int8).view(n, k // 2), s_rel.view(n, g), s_channel.contiguous()
    return codes.t().reshape(n, k), s_rel.view(n, g), s_channel.contiguous()
