"""asym_w4a8_int8 codec: packing, decode, encode quality, input validation, kitchen oracle."""

from __future__ import annotations

import json

import pytest
import torch

from h3quant.convrot import rotate
from h3quant.errors import FormatError, UnsupportedError
from h3quant.formats.w4a8 import tensors as W
from h3quant.formats.w4a8 import codebook as CB
from h3quant.formats.w4a8.tensors import (
    FROZEN_CODEBOOK,
    decode_w4a8,
    decode_w4a8_int8,
    encode_w4a8,
    pack_nibbles,
    relative_l2,
    unpack_nibbles,
)
from h3quant.formats.w4a8.codec import w4a8_marker

N, K = 256, 1024


def _gauss(seed=0, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02


def _outlier_cols(seed=1, n=N, k=K, count=8, factor=100.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    cols = torch.randperm(k, generator=g)[:count]
    w[:, cols] *= factor
    return w


def _student_t(seed=2, n=N, k=K, df=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g)
    chi2 = torch.randn(int(df), n, k, generator=g).square().sum(0)
    return z / (chi2 / df).sqrt() * 0.02


CASES = {
    "gaussian": _gauss,
    "gaussian_1pct_cols_x30": lambda: _outlier_cols(count=K // 100, factor=30.0),
    "gaussian_8_cols_x100": _outlier_cols,
    "student_t3": _student_t,
}


# ----------------------------------------------------------------------------- packing


def test_pack_golden_bytes():
    packed = pack_nibbles(torch.tensor([[3, 12, 0, 15]], dtype=torch.uint8))
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[0xC3, 0xF0]]
    assert packed.tolist() == [[0xC3 - 256, 0xF0 - 256]]  # two's complement as stored


def test_unpack_golden_bytes():
    packed = torch.tensor([[0xC3 - 256, 0xF0 - 256]], dtype=torch.int8)
    assert unpack_nibbles(packed).tolist() == [[3, 12, 0, 15]]
    assert unpack_nibbles(packed.view(torch.uint8)).dtype == torch.uint8


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (37, 64), generator=g, dtype=torch.int64)
    packed = pack_nibbles(codes)
    assert packed.shape == (37, 32)
    assert torch.equal(unpack_nibbles(packed).long(), codes)
    # every byte value decodes to its own nibbles
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)
    assert torch.equal(pack_nibbles(unpack_nibbles(all_bytes)).view(torch.uint8), all_bytes)


@pytest.mark.parametrize("bad", [
    torch.zeros(4, dtype=torch.uint8),                      # 1-D
    torch.zeros(2, 3, dtype=torch.uint8),                   # odd K
    torch.tensor([[0, 16]]),                                # out of range
    torch.tensor([[-1, 0]]),
    torch.zeros(2, 2),                                      # float
])
def test_pack_rejects(bad):
    with pytest.raises(FormatError):
        pack_nibbles(bad)


# ----------------------------------------------------------------------------- decode


def test_decode_int8_worked_example():
    # s_rel 64 with the frozen table: levels -0.500986, 0.502636, -0.980602, 0.980671
    packed = pack_nibbles(torch.tensor([[3, 12, 0, 15] * 4], dtype=torch.uint8))
    s_rel = torch.tensor([[64.0]]).to(torch.float8_e4m3fn)
    w8 = decode_w4a8_int8(packed, s_rel, codebook=FROZEN_CODEBOOK)
    assert w8.dtype == torch.int8
    assert w8.tolist() == [[-32, 32, -63, 63] * 4]
    # the same scale as raw e4m3 bits (64 = 2^6: exponent 6 + bias 7 = 13 -> 0b0_1101_000)
    bits = torch.tensor([[0x68]], dtype=torch.uint8)
    assert torch.equal(s_rel.view(torch.uint8), bits)
    assert torch.equal(decode_w4a8_int8(packed, bits, codebook=FROZEN_CODEBOOK), w8)


def test_decode_int8_without_codebook_is_code_minus_8_and_clamps():
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16)
    packed = pack_nibbles(codes)
    s_rel = torch.tensor([[20.0]]).to(torch.float8_e4m3fn)
    expected = ((torch.arange(16) - 8) * 20).clamp(-127, 127)
    assert decode_w4a8_int8(packed, s_rel).tolist() == [expected.tolist()]


def test_frozen_codebook_values():
    assert FROZEN_CODEBOOK.dtype == torch.float32 and FROZEN_CODEBOOK.shape == (16,)
    assert torch.all(FROZEN_CODEBOOK[1:] > FROZEN_CODEBOOK[:-1])
    assert FROZEN_CODEBOOK[0].item() == pytest.approx(-0.980602)
    assert FROZEN_CODEBOOK[15].item() == pytest.approx(0.980671)


def test_decode_is_int8_grid_times_channel_scale_rotated_back():
    t = encode_w4a8(_gauss(seed=5, n=32, k=512))
    w8 = decode_w4a8_int8(t["weight"], t["weight_s_rel"], codebook=t["weight_codebook"])
    manual = rotate(w8.float() * t["weight_s_channel"][:, None], 256)
    assert torch.equal(decode_w4a8(t), manual)
    assert decode_w4a8(t, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_marker_bytes():
    assert json.dumps(w4a8_marker()) == '{"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}'


# ----------------------------------------------------------------------------- encode


def test_encode_tensor_names_dtypes_shapes():
    w = _gauss(n=64, k=512).bfloat16()
    t = encode_w4a8(w)
    assert set(t) == {"weight", "weight_s_rel", "weight_s_channel", "weight_codebook"}
    assert t["weight"].dtype == torch.int8 and t["weight"].shape == (64, 256)
    assert t["weight_s_rel"].dtype == torch.float8_e4m3fn and t["weight_s_rel"].shape == (64, 32)
    assert t["weight_s_channel"].dtype == torch.float32 and t["weight_s_channel"].shape == (64,)
    assert t["weight_codebook"].dtype == torch.float32 and t["weight_codebook"].shape == (16,)
    s = t["weight_s_rel"].float()
    assert torch.isfinite(s).all() and (s > 0).all() and (t["weight_s_channel"] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_error(name):
    w = CASES[name]()
    err = relative_l2(w, decode_w4a8(encode_w4a8(w)))
    assert err <= 0.075, f"{name}: relative L2 {err:.4f}"
    err_bf16 = relative_l2(w.bfloat16().float(), decode_w4a8(encode_w4a8(w.bfloat16())))
    assert err_bf16 <= 0.075


def test_each_weight_takes_the_nearest_decoded_level():
    w = _outlier_cols(n=64, k=512)
    t = encode_w4a8(w)
    w8 = decode_w4a8_int8(t["weight"], t["weight_s_rel"], codebook=t["weight_codebook"]).float()
    target = rotate(w, 256) / t["weight_s_channel"][:, None]
    levels = (t["weight_codebook"] * t["weight_s_rel"].float().unsqueeze(-1)).round().clamp(-127, 127)
    levels = levels.repeat_interleave(16, dim=1)  # [n, K, 16]
    best = (target.unsqueeze(-1) - levels).abs().min(-1).values
    assert torch.allclose((target - w8).abs(), best, atol=1e-4)


@pytest.mark.slow
def test_auto_keeps_frozen_table_for_gaussian_and_fits_heavy_outliers():
    t = encode_w4a8(_gauss())
    assert torch.equal(t["weight_codebook"], FROZEN_CODEBOOK)
    w = _outlier_cols()
    auto = encode_w4a8(w)
    cb = auto["weight_codebook"]
    assert not torch.equal(cb, FROZEN_CODEBOOK)
    assert torch.all(cb[1:] >= cb[:-1]) and cb.abs().max() <= 1.0
    frozen = encode_w4a8(w, codebook="frozen")
    assert torch.equal(frozen["weight_codebook"], FROZEN_CODEBOOK)
    assert relative_l2(w, decode_w4a8(auto)) < relative_l2(w, decode_w4a8(frozen))
    assert torch.equal(encode_w4a8(w, codebook="fit")["weight_codebook"], cb)


def test_zero_rows_and_groups_stay_finite_and_decode_to_zero():
    w = _gauss(n=8, k=512)
    w[2] = 0.0
    w[5, :256] = 0.0  # a whole zero rotation block -> zero groups after rotation
    t = encode_w4a8(w)
    s = t["weight_s_rel"].float()
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(t["weight_s_channel"]).all() and (t["weight_s_channel"] > 0).all()
    d = decode_w4a8(t)
    assert torch.isfinite(d).all()
    assert torch.equal(d[2], torch.zeros(512)) and torch.equal(d[5, :256], torch.zeros(256))
    z = encode_w4a8(torch.zeros(4, 256))
    assert torch.equal(decode_w4a8(z), torch.zeros(4, 256))


@pytest.mark.slow
def test_encode_does_not_depend_on_chunking(monkeypatch):
    w = _outlier_cols(n=64, k=512)
    whole = encode_w4a8(w)
    monkeypatch.setattr(W, "_ROW_ELEM_BUDGET", 3 * 512)  # 3 rows per chunk
    chunked = encode_w4a8(w)
    for key in whole:
        def raw(t):
            return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

        assert torch.equal(raw(whole[key]), raw(chunked[key]))


def test_scale_search_improves_on_plain_rounding():
    x = rotate(_gauss(seed=9, n=64, k=1024), 256)
    index = CB.LevelIndex(FROZEN_CODEBOOK)
    errs = []
    for search in (0, W.SCALE_SEARCH_ULPS):
        codes, s_rel, s_ch = W._encode_rows(x, index, 16, search=search)
        t = {"weight": pack_nibbles(codes), "weight_s_rel": s_rel, "weight_s_channel": s_ch,
             "weight_codebook": FROZEN_CODEBOOK}
        errs.append(relative_l2(x, rotate(decode_w4a8(t), 256)))
    assert errs[1] < errs[0]


# ----------------------------------------------------------------------------- helpers


@pytest.mark.parametrize("table", [
    FROZEN_CODEBOOK,
    torch.linspace(-1, 1, 16),
    torch.tensor([-1.0] * 3 + [0.0] * 10 + [0.5, 0.50001, 1.0]),  # duplicates, near-ties
])
def test_level_index_matches_bucketize(table):
    g = torch.Generator().manual_seed(4)
    u = torch.cat([torch.randn(20000, generator=g) * 1.5, CB.level_midpoints(table), torch.tensor([-9.0, 9.0])])
    got = CB.LevelIndex(table).nearest(u).long()
    ref = torch.bucketize(u, CB.level_midpoints(table))
    assert torch.equal((u - table[got]).abs(), (u - table[ref]).abs())


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("shape,kwargs,match", [
    ((16,), {}, "2-D"),
    ((4, 4, 256), {}, "2-D"),
    ((4, 264), {}, "K % 16"),
    ((4, 256), {"group_size": 64}, None),          # valid: multiple of 16
    ((4, 272), {}, "convrot_groupsize"),           # 272 % 16 == 0 but not % 256
    ((4, 256), {"group_size": 12}, "group_size"),
    ((4, 256), {"convrot_groupsize": 128}, "power of 4"),
    ((4, 256), {"group_size": 512}, "group_size 512"),
    ((4, 256), {"codebook": "nf4"}, "codebook"),
    ((0, 256), {}, "no rows"),
])
def test_encode_validation(shape, kwargs, match):
    w = torch.randn(*shape)
    if match is None:
        encode_w4a8(w, **kwargs)
        return
    with pytest.raises(FormatError, match=match):
        encode_w4a8(w, **kwargs)


def test_encode_rejects_integer_and_non_finite():
    with pytest.raises(FormatError, match="floating"):
        encode_w4a8(torch.zeros(4, 256, dtype=torch.int8))
    w = torch.randn(4, 256)
    w[1, 3] = float("nan")
    with pytest.raises(FormatError, match="NaN"):
        encode_w4a8(w)
    with pytest.raises(FormatError):
        encode_w4a8([[0.0] * 256])


def test_decode_validation():
    t = encode_w4a8(_gauss(n=8, k=256))
    with pytest.raises(FormatError, match="weight_s_rel must have shape"):
        decode_w4a8_int8(t["weight"], t["weight_s_rel"][:, :8])
    with pytest.raises(FormatError, match="int8"):
        decode_w4a8_int8(t["weight"].float(), t["weight_s_rel"])
    nan_bits = t["weight_s_rel"].view(torch.uint8).clone()
    nan_bits[0, 0] = 0x7F
    with pytest.raises(FormatError, match="NaN"):
        decode_w4a8_int8(t["weight"], nan_bits)
    with pytest.raises(FormatError, match="codebook"):
        decode_w4a8_int8(t["weight"], t["weight_s_rel"], codebook=torch.zeros(8))
    with pytest.raises(FormatError, match="missing 'weight_s_channel'"):
        decode_w4a8({k: v for k, v in t.items() if k != "weight_s_channel"})
    with pytest.raises(FormatError, match="weight_s_channel"):
        decode_w4a8({**t, "weight_s_channel": torch.ones(7)})
    with pytest.raises(FormatError, match="convrot_groupsize"):
        decode_w4a8(t, convrot_groupsize=1024)
    with pytest.raises(UnsupportedError, match="weight_correction"):
        decode_w4a8({**t, "weight_correction": torch.zeros(16, 8)})


def test_codebook_is_always_stored_because_absence_means_code_minus_8():
    t = encode_w4a8(_gauss(n=16, k=256), codebook="frozen")
    w = decode_w4a8(t)
    without = decode_w4a8({k: v for k, v in t.items() if k != "weight_codebook"})
    assert relative_l2(w, without) > 1.0  # uniform code-8 levels would be a different weight


# ----------------------------------------------------------------------------- kitchen oracle


def _kitchen():
    ck = pytest.importorskip("comfy_kitchen")
    import comfy_kitchen.tensor  # noqa: F401  (registers the layouts)
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout
    return ck, QuantizedTensor, AsymW4A8Int8Layout


def _kitchen_tensor(t, shape, dtype=torch.float32):
    _, QuantizedTensor, Layout = _kitchen()
    params = Layout.Params(scale=t["weight_s_rel"], s_channel=t["weight_s_channel"],
                           codebook=t.get("weight_codebook"), orig_dtype=dtype, orig_shape=tuple(shape))
    return QuantizedTensor(t["weight"], "AsymW4A8Int8Layout", params)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gaussian", "gaussian_8_cols_x100"])
def test_kitchen_dequantizes_our_tensors_like_we_do(name):
    w = CASES[name]()
    t = encode_w4a8(w)
    ours = decode_w4a8(t)
    theirs = _kitchen_tensor(t, w.shape).dequantize().float()
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))
    eager = pytest.importorskip("comfy_kitchen.backends.eager.w4a8_int8")
    to_int8 = getattr(eager, "_dequant_int4_grouped_to_int8", None)
    if to_int8 is not None:  # private helper: the exact int8 grid the runtime multiplies
        w8 = to_int8(t["weight"], t["weight_s_rel"], t["weight_codebook"], 16)
        assert torch.equal(w8, decode_w4a8_int8(t["weight"], t["weight_s_rel"], codebook=t["weight_codebook"]))


def test_kitchen_linear_on_our_tensors_matches_dequantized_matmul():
    w = _gauss(seed=7, n=64, k=512)
    t = encode_w4a8(w)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(8))
    y = torch.nn.functional.linear(x, _kitchen_tensor(t, w.shape))
    ref = x @ decode_w4a8(t).T
    assert relative_l2(ref, y.float()) < 0.02  # kitchen quantizes x to int8 per token


@pytest.mark.slow
@pytest.mark.parametrize("codebook", ["default", "custom"])
def test_we_decode_kitchen_tensors_like_kitchen(codebook):
    _, QuantizedTensor, _ = _kitchen()
    w = _outlier_cols(seed=11)
    kwargs = {}
    if codebook == "custom":
        kwargs["codebook_tensor"] = torch.linspace(-1.0, 1.0, 16) ** 3  # sorted, non-uniform
    qt = QuantizedTensor.from_float(w, "AsymW4A8Int8Layout", **kwargs)
    sd = qt.state_dict("L.weight")
    local = {key[len("L."):]: v for key, v in sd.items()}
    assert "weight_correction" not in local
    ours = decode_w4a8(local)
    theirs = qt.dequantize().float()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * float(theirs.abs().max()))
    local["weight_s_rel"] = local["weight_s_rel"].view(torch.uint8)  # U8 storage of e4m3 bits
    assert torch.equal(decode_w4a8(local), ours)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_quality_not_worse_than_kitchen(name):
    _, QuantizedTensor, _ = _kitchen()
    w = CASES[name]()
    ours = relative_l2(w, decode_w4a8(encode_w4a8(w)))
    theirs = relative_l2(w, QuantizedTensor.from_float(w, "AsymW4A8Int8Layout").dequantize().float())
    assert ours <= theirs * 1.001, f"{name}: ours {ours:.5f} kitchen {theirs:.5f}"


def test_relative_l2_matches_direct_formula(monkeypatch):
    a = _gauss(seed=12, n=8, k=256)
    b = a + 0.001 * _gauss(seed=13, n=8, k=256)
    direct = ((a.double() - b.double()).norm() / a.double().norm()).item()
    monkeypatch.setattr(W, "_ROW_ELEM_BUDGET", 100)  # force several chunks
    assert relative_l2(a, b) == pytest.approx(direct, rel=1e-12)
    assert relative_l2(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(FormatError):
        relative_l2(a, b[:4])


def test_returned_codebook_is_a_copy():
    t = encode_w4a8(_gauss(n=4, k=256), codebook="frozen")
    t["weight_codebook"].zero_()
    assert FROZEN_CODEBOOK.abs().min() > 0.05
