"""The fast W4A8 encoder (decoded-level table, group-major chunks) against a brute-force one.

The reference below is the encoder's specification written plainly: ALS group scales, the row
scale from the largest reconstructed value, e4m3 group scales, then per group the scale among
``s_rel`` and its +-search e4m3 neighbours whose nearest decoded levels (searched over all 16)
give the smallest squared error, the first best in the order 0, -1, +1, -2, +2. The fast
encoder must choose the same scales and the same decoded int8 weights (a weight exactly between
two decoded levels may take either: same error), and its error must not be larger.
"""

from __future__ import annotations

import pytest
import torch

from h3quant.convrot import rotate
from h3quant.formats.w4a8 import tensors as W
from h3quant.formats.w4a8 import codebook as CB
from h3quant.formats.w4a8.tensors import (
    FROZEN_CODEBOOK,
    decode_w4a8_int8,
    encode_w4a8,
    pack_nibbles,
)
from h3quant.formats.w4a8.encoder import (
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    DecodedLevels,
    encode_rows,
)


def _weights(seed, n=24, k=512, kind="outliers"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if kind == "outliers":
        cols = torch.randperm(k, generator=g)[: k // 50]
        w[:, cols] *= 30.0
        w[: n // 10] *= 8.0
    elif kind == "heavy":
        w = w / torch.randn(n, k, generator=g).abs().clamp(min=0.05)
    elif kind == "zeros":
        w[::3] = 0.0
        w[1, :256] = 0.0
    return w


def _reference_rows(x, table, group_size=16, search=2):
    """Brute force: every decoded level of every candidate scale, all in float64-free fp32."""
    n, k = x.shape
    gx = x.view(n, k // group_size, group_size)
    codes, scale, zero = CB.als_group_scales(gx, table)
    reach = (table[codes.long()].abs().amax(-1, keepdim=True) * scale).masked_fill(zero, 0.0)
    s_ch = reach.amax(dim=(1, 2)) / 127.0
    s_ch = torch.where(s_ch > 0, s_ch, torch.ones_like(s_ch))
    s_rel = (scale / s_ch.view(n, 1, 1)).masked_fill(zero, 0.0)
    bits = s_rel.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).long()
    target = gx / s_ch.view(n, 1, 1)
    best_err = best_bits = None
    for d in [0] + [i for j in range(1, search + 1) for i in (-j, j)]:
        cand = (bits + d).clamp(1, 0x7E)
        s = cand.to(torch.uint8).view(torch.float8_e4m3fn).float()  # [n, g, 1]
        dec = (table * s).round().clamp(-127, 127)  # [n, g, 16 levels]
        err = (target.unsqueeze(-1) - dec.unsqueeze(-2)).square().min(-1).values.sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_bits = err, cand
        else:
            better = err < best_err
            best_err = torch.minimum(best_err, err)
            best_bits = torch.where(better, cand, best_bits)
    s = best_bits.to(torch.uint8).view(torch.float8_e4m3fn)
    dec = (table * s.float()).round().clamp(-127, 127)
    pick = (target.unsqueeze(-1) - dec.unsqueeze(-2)).abs().argmin(-1)
    w8 = torch.gather(dec, 2, pick)
    return s.view(n, -1), s_ch, w8.view(n, k), target.view(n, k)


TABLES = {
    "frozen": FROZEN_CODEBOOK,
    "uniform": torch.linspace(-1, 1, 16),
    "random": torch.sort(torch.rand(16, generator=torch.Generator().manual_seed(3)) * 2 - 1).values,
}


@pytest.mark.parametrize("kind", ["outliers", "heavy", "zeros"])
@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("search", [0, 2, 3, 4])
def test_fast_rows_choose_the_reference_scales_and_int8_weights(kind, table, search):
    tab = TABLES[table]
    x = rotate(_weights(7, kind=kind), 256)
    codes, s_rel, s_ch = encode_rows(x, CB.LevelIndex(tab), 16, search)
    ref_s, ref_ch, ref_w8, target = _reference_rows(x, tab, search=search)
    assert torch.equal(s_ch, ref_ch)
    assert torch.equal(s_rel.view(torch.uint8), ref_s.view(torch.uint8))
    w8 = decode_w4a8_int8(pack_nibbles(codes), s_rel, codebook=tab).float()
    # identical except where the target lies exactly between two decoded levels
    assert torch.equal((target - w8).abs(), (target - ref_w8).abs())


def test_decoded_levels_table_is_the_nearest_decoded_level():
    g = torch.Generator().manual_seed(6)
    for table in TABLES.values():
        lv = DecodedLevels(table)
        t = torch.cat([torch.randn(4000, generator=g) * 60, torch.arange(-130, 130, 0.5),
                       torch.tensor([-1e6, 1e6, 127.75, -127.75])])
        for bits in (1, 2, 17, 56, 100, 0x7E):
            s = torch.tensor([bits], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            dec = (table * s).round().clamp(-127, 127)
            q = torch.floor(2 * t).clamp(-256, 255)
            idx = ((q + 256) * 128 + bits).to(torch.int32)  # the table's row: (bin, scale bits)
            rows = DecodedLevels.rows(t.view(1, -1), torch.tensor([bits], dtype=torch.uint8))
            assert torch.equal(rows.view(-1), idx)
            got_v, got_c = lv.value[idx.long()], lv.code[idx.long()]
            best = (t.unsqueeze(-1) - dec).abs().min(-1).values
            assert torch.equal((t - got_v).abs(), best)
            assert torch.equal(dec[got_c.long()], got_v)  # the code decodes to that value


@pytest.mark.slow
def test_encoder_matches_reference_error_on_a_layer(monkeypatch):
    w = _weights(11, n=32, k=1024)
    t = encode_w4a8(w, codebook="frozen")
    x = rotate(w, 256)
    _, _, ref_w8, target = _reference_rows(x, FROZEN_CODEBOOK)
    w8 = decode_w4a8_int8(t["weight"], t["weight_s_rel"], codebook=t["weight_codebook"]).float()
    assert torch.equal((target - w8).abs(), (target - ref_w8).abs())
    monkeypatch.setattr(W, "_ROW_ELEM_BUDGET", 5 * 1024)  # chunking changes nothing
    again = encode_w4a8(w, codebook="frozen")
    assert torch.equal(again["weight"], t["weight"])


@pytest.mark.parametrize("table", sorted(TABLES))
def test_ambiguous_cells_are_redone_exactly(table):
    """A coarse grid puts many values in cells holding a midpoint: those groups are redone."""
    from h3quant.formats.w4a8.encoder import FineLevels

    tab = TABLES[table]
    x = rotate(_weights(5, kind="heavy"), 256)
    index = CB.LevelIndex(tab)
    levels = DecodedLevels(tab)
    levels._fine = FineLevels(index, bins=32)
    assert torch.isnan(levels._fine.lut).float().mean() > 0.3
    codes, s_rel, s_ch = encode_rows(x, index, 16, 2, levels)
    ref_s, ref_ch, ref_w8, target = _reference_rows(x, tab, search=2)
    assert torch.equal(s_ch, ref_ch)
    assert torch.equal(s_rel.view(torch.uint8), ref_s.view(torch.uint8))


def test_integer_key_sort_equals_a_float_sort():
    """``sort_floats`` (radix sort of int32 keys) gives the same values in the same order as
    ``Tensor.sort``: signs, subnormals, zeros of both signs and infinities included."""
    from h3quant.formats.w4a8.codebook import sort_floats

    g = torch.Generator().manual_seed(9)
    cases = [torch.randn(50000, generator=g) * torch.exp(torch.randn(50000, generator=g) * 8),
             torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, float("inf"), -float("inf"),
                           3.4e38, -3.4e38, 2.0, 2.0, -2.0]),
             torch.rand(1000, generator=g) * 2 - 1]
    for u in cases:
        got = sort_floats(u)
        want = u.sort().values
        assert torch.equal(got, want)
        assert torch.equal(torch.signbit(got[got == 0]), torch.signbit(want[want == 0]).sort(descending=True).values)


def test_fitted_codebook_is_unchanged_by_the_integer_sort():
    """The k-means table from the radix-sorted sample equals the one from a float sort."""
    from h3quant.formats.w4a8 import codebook as C

    x = rotate(_weights(13, n=64, k=1024, kind="heavy"), 256)
    u = C.normalise_groups(x, 16)
    fast = C.fit_codebook(u)
    real = C.sort_floats
    try:
        C.sort_floats = lambda v: v.sort().values
        slow = C.fit_codebook(u)
    finally:
        C.sort_floats = real
    assert torch.equal(fast, slow)


@pytest.mark.slow
def test_pool_encodes_the_same_bytes_and_reports_the_first_bad_rows(monkeypatch):
    """Row chunks on a thread pool: byte-identical output; a non-finite value outside the
    codebook sample is reported with its chunk's rows (the first bad chunk in row order)."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(W, "_ROW_ELEM_BUDGET", 64 * 1024)  # 64 rows per chunk: many chunks
    w = _weights(21, n=64, k=1024)
    one = encode_w4a8(w)
    bits = {k: (lambda t: t.view(torch.uint8) if t.dtype != torch.float32 else t) for k in one}
    with ThreadPoolExecutor(3) as pool:
        par = encode_w4a8(w, pool=pool)
        assert all(torch.equal(bits[k](one[k]), bits[k](par[k])) for k in one)
        big = _weights(22, n=2048, k=1024)
        row_ids = torch.arange(2048.0).view(-1, 1).expand(-1, 1024).contiguous()
        sampled = set(CB.sample_rows(row_ids)[:, 0].long().tolist())
        late = next(r for r in range(1000, 2048) if r not in sampled)
        later = next(r for r in range(late // 64 * 64 + 64, 2048) if r not in sampled)
        big[later, 3] = float("inf")
        big[late, 7] = float("nan")
        with pytest.raises(W.FormatError, match=rf"NaN or inf \(rows {late // 64 * 64}\.\.{late // 64 * 64 + 63}\)"):
            encode_w4a8(big, pool=pool)


@pytest.mark.slow
def test_fine_levels_need_no_clamp_within_their_reach():
    """The padded fine table read without a clamp (values within +-REACH) gives the clamped
    lookup's levels, NaN (ambiguous) cells included; beyond the reach the clamp still runs."""
    from h3quant.formats.w4a8.encoder import FineLevels

    g = torch.Generator().manual_seed(21)
    for table in TABLES.values():
        fine = FineLevels(CB.LevelIndex(table))
        scale = torch.rand(4096, generator=g) + 0.01
        u = (torch.rand(16, 4096, generator=g) * 2 - 1) * FineLevels.REACH
        u[0, :8] = torch.tensor([1.0, -1.0, 1.25, -1.25, 0.0, 1 - 2**-20, -1 + 2**-20, 2**-30])
        x = u * scale
        reach = float((x.abs() / scale).amax())
        assert reach <= FineLevels.REACH
        free, clamped = fine.levels(x, scale, reach), fine.levels(x, scale)
        torch.testing.assert_close(free, clamped, rtol=0, atol=0, equal_nan=True)
        want = table[CB.LevelIndex(table).nearest(x / scale)]
        ok = ~torch.isnan(free)
        assert torch.equal(free[ok], want[ok]) and ok.float().mean() > 0.99
        far = x * 40  # |x / scale| up to 50: the clamp keeps the cells in the table
        ends = fine.levels(far, scale)
        beyond = (far / scale).abs() > 1
        want_end = torch.where(far > 0, table[-1], table[0])
        assert torch.equal(ends[beyond], want_end[beyond])


def test_second_round_past_the_reach_takes_the_clamped_lookup(monkeypatch):
    """With the reach lowered below what heavy-tailed groups show in the second ALS round,
    those rounds take the clamped lookup, and the encoder still picks the reference scales."""
    from h3quant.formats.w4a8.encoder import FineLevels

    seen = []
    real = FineLevels.levels
    monkeypatch.setattr(FineLevels, "REACH", 1.02)
    monkeypatch.setattr(FineLevels, "levels", lambda self, xt, s, reach=float("inf"):
                        seen.append(reach) or real(self, xt, s, reach))
    x = rotate(_weights(7, kind="heavy"), 256)
    codes, s_rel, s_ch = encode_rows(x, CB.LevelIndex(FROZEN_CODEBOOK), 16, 2)
    assert min(seen) <= FineLevels.REACH < max(seen)
    ref_s, ref_ch, _, _ = _reference_rows(x, FROZEN_CODEBOOK)
    assert torch.equal(s_ch, ref_ch)
    assert torch.equal(s_rel.view(torch.uint8), ref_s.view(torch.uint8))


@pytest.mark.slow
def test_one_pass_squared_differences_match_the_two_pass_ones(monkeypatch):
    """mse_loss's unreduced kernel is used only after a self-check; with it refused, the plain
    subtraction and square give the same bytes."""
    from h3quant.formats.w4a8 import encoder as WE

    w = _weights(17, n=40, k=1024, kind="outliers")
    assert WE._mse_ok()
    fast = encode_w4a8(w, codebook="auto")
    monkeypatch.setattr(WE, "_MSE_OK", [False])
    slow = encode_w4a8(w, codebook="auto")
    for key in fast:
        assert torch.equal(fast[key].view(torch.uint8) if fast[key].dtype == torch.float8_e4m3fn else fast[key],
                           slow[key].view(torch.uint8) if slow[key].dtype == torch.float8_e4m3fn else slow[key])
