"""int8_tensorwise codec (FORMATS.md 2, 3, 3.1): worked example, references, kitchen bit-exactness."""

import json

import numpy as np
import pytest
import torch

from h3quant.convrot import GroupSizeError, rotate, rotate_dense
from h3quant.errors import FormatError, UnsupportedError
from h3quant.formats.int8.tensors import decode_int8, encode_int8, quantize_activation
from h3quant.formats.int8.codec import int8_marker

H4 = np.array([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=np.float64)


def _h64(g: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < g:
        h = np.kron(h, H4)
    return h / np.sqrt(g)


def _reference_encode(w: torch.Tensor, g: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Slow, independent float64 reference of FORMATS.md 3 (explicit per-block loop)."""
    x = w.double().numpy()
    if g:
        h = _h64(g)
        x = x.copy()
        for b in range(0, x.shape[1], g):
            x[:, b:b + g] = x[:, b:b + g] @ h
    s = np.maximum(np.abs(x).max(axis=1, keepdims=True) / 127.0, 1e-30)
    return np.clip(np.round(x / s), -128, 127), s  # np.round is half to even


def _weights(n: int, k: int, seed: int = 0, outliers: int = 4) -> torch.Tensor:
    """bf16 gaussian weights with a few large-outlier input columns (like real DiT layers)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    cols = torch.randint(0, k, (outliers,), generator=gen)
    w[:, cols] *= torch.linspace(20, 100, outliers)
    return w.to(torch.bfloat16)


# --- FORMATS.md 2: canonical marker -----------------------------------------------------------

def test_marker_convrot_bytes():
    m = int8_marker()
    assert m == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    raw = json.dumps(m).encode("utf-8")
    assert raw == b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}'
    assert len(raw) == 72


def test_marker_plain_and_other_group():
    assert int8_marker(convrot=False) == {"format": "int8_tensorwise"}
    assert json.dumps(int8_marker(True, 64)).endswith('"convrot_groupsize": 64}')
    with pytest.raises(GroupSizeError):
        int8_marker(True, 128)


# --- FORMATS.md 3.1 worked example (g = 4) ----------------------------------------------------

W_EX = [[.5, -1, .25, 2, .1, .2, -.3, .4], [-.7, 0, 1.5, .3, .05, -.05, .6, -2.5]]


def test_worked_example_weight():
    w = torch.tensor(W_EX)
    torch.testing.assert_close(rotate_dense(w, 4), torch.tensor(
        [[-1.125, .625, 1.875, .375, -.2, .5, 0, .1], [.25, -.95, .55, 1.25, 1.55, -1.55, -.9, -1]]),
        rtol=0, atol=1e-6)
    q, s = encode_int8(w, group_size=4)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2, 1)
    assert q.tolist() == [[-76, 42, 127, 25, -14, 34, 0, 7], [20, -78, 45, 102, 127, -127, -74, -82]]
    torch.testing.assert_close(s.view(-1), torch.tensor([0.01476378, 0.01220472]), rtol=1e-6, atol=0)
    assert torch.equal(s.view(-1), rotate_dense(w, 4).abs().amax(1) / 127)  # fp32 steps 3


def test_worked_example_activation_and_product():
    w = torch.tensor(W_EX)
    q, s = encode_int8(w, group_size=4)
    x = torch.tensor([[8, 0, 0, 0, -1, .5, 0, 2]])
    xr = rotate(x, 4)
    assert xr.tolist() == [[4, 4, 4, -4, -1.25, .75, .25, 1.75]]
    qx, sx = quantize_activation(xr)
    assert sx.shape == (1,) and sx.item() == np.float32(4 / 127)
    assert qx.tolist() == [[127, 127, 127, -127, -40, 24, 8, 56]]
    acc = qx.long() @ q.long().T
    assert acc.tolist() == [[10404, -27917]]
    y = acc.float() * sx[:, None] * s.view(1, -1)
    torch.testing.assert_close(y, torch.tensor([[4.8379, -10.7313]]), rtol=0, atol=1e-4)
    torch.testing.assert_close(x @ w.T, torch.tensor([[4.8, -10.675]]), rtol=0, atol=1e-5)


# --- against an independent reference --------------------------------------------------------

@pytest.mark.parametrize("g", [4, 16, 64, 256])
def test_matches_float64_reference(g):
    w = _weights(96, 4 * g, seed=g)
    q, s = encode_int8(w, group_size=g)
    q_ref, s_ref = _reference_encode(w, g)
    np.testing.assert_allclose(s.numpy(), s_ref, rtol=2e-7, atol=0)
    diff = np.abs(q.numpy().astype(np.int64) - q_ref)
    assert diff.max() <= 1  # fp32 vs float64 rounding can only move a .5 tie
    assert (diff > 0).mean() < 1e-3


def test_plain_rowwise_matches_reference_exactly():
    w = _weights(64, 300, seed=5)  # no rotation: no summation, so fp32 == float64 here
    q, s = encode_int8(w, convrot=False)
    q_ref, s_ref = _reference_encode(w, None)
    assert np.array_equal(q.numpy(), q_ref)
    np.testing.assert_allclose(s.numpy(), s_ref, rtol=2e-7)


# --- rounding, clamps, zero rows, scalar scale ------------------------------------------------

def test_round_half_to_even():
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]])  # scale = 127 / 127 = 1
    q, s = encode_int8(w, convrot=False)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 4]]
    qx, sx = quantize_activation(w)
    assert qx.tolist() == q.tolist() and sx.tolist() == [1.0]


@pytest.mark.parametrize("convrot", [True, False])
def test_zero_rows(convrot):
    w = _weights(8, 512, seed=1).float()
    w[[2, 5]] = 0
    q, s = encode_int8(w, convrot=convrot, group_size=256)
    assert s[2].item() == s[5].item() == np.float32(1e-30)
    assert not q[2].any() and not q[5].any()
    assert q[0].abs().max() == 127
    assert not decode_int8(q, s, convrot=convrot)[[2, 5]].any()


def test_scalar_scale_mode():
    w = _weights(16, 64, seed=2)
    q, s = encode_int8(w, convrot=False, per_row=False)
    assert s.shape == () and s.dtype == torch.float32
    assert s.item() == np.float32(w.float().abs().max().item() / 127)
    assert q.abs().max() == 127
    ref = torch.round(w.float() / s).to(torch.int8)
    assert torch.equal(q, ref)
    torch.testing.assert_close(decode_int8(q, s, convrot=False), q.float() * s, rtol=0, atol=0)


def test_convrot_needs_per_row():
    with pytest.raises(UnsupportedError):
        encode_int8(torch.randn(4, 256), convrot=True, per_row=False)


# --- decode ----------------------------------------------------------------------------------

@pytest.mark.parametrize("exact", [True, False])
def test_decode_roundtrip(exact):
    w = _weights(64, 1024, seed=3).float()
    q, s = encode_int8(w)
    for scale in (s, s.view(-1)):
        back = decode_int8(q, scale, convrot=True, exact=exact)
        assert back.shape == w.shape and back.dtype == torch.float32
        rel = (back - w).norm() / w.norm()
        assert rel < 0.02
    assert decode_int8(q, s, convrot=True, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_decode_fast_equals_exact_to_rounding():
    w = _weights(32, 512, seed=4)
    q, s = encode_int8(w)
    torch.testing.assert_close(decode_int8(q, s, convrot=True, exact=False),
                               decode_int8(q, s, convrot=True), rtol=0, atol=1e-5)


def test_decode_rejects_bad_shapes():
    q = torch.zeros(4, 256, dtype=torch.int8)
    with pytest.raises(FormatError):
        decode_int8(q, torch.ones(3, 1), convrot=True)
    with pytest.raises(FormatError):
        decode_int8(q.float(), torch.ones(4, 1), convrot=True)
    with pytest.raises(FormatError):
        decode_int8(q[:, :100], torch.ones(4, 1), convrot=True)


# --- input validation ------------------------------------------------------------------------

@pytest.mark.parametrize("bad, kwargs, err", [
    (torch.randn(256), {}, FormatError),
    (torch.randn(2, 2, 256), {}, FormatError),
    (torch.randn(4, 300), {}, FormatError),  # K % 256
    (torch.randn(4, 256), {"group_size": 128}, FormatError),  # not a power of 4
    (torch.randn(4, 0), {"convrot": False}, FormatError),
    (torch.ones(4, 256, dtype=torch.int32), {}, FormatError),
    (torch.randn(4, 256), {"method": "turbo"}, ValueError),
])
def test_encode_rejects(bad, kwargs, err):
    with pytest.raises(err):
        encode_int8(bad, **kwargs)


@pytest.mark.parametrize("convrot", [True, False])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_encode_rejects_non_finite(convrot, value):
    w = torch.randn(6, 256)
    w[3, 7] = value
    with pytest.raises(FormatError, match="row 3"):
        encode_int8(w, convrot=convrot)


# --- row independence (the converter encodes row chunks) -------------------------------------

@pytest.mark.parametrize("method", ["exact", "dense", "fast"])
def test_row_chunks_equal_whole(method):
    w = _weights(150, 768, seed=6)
    q, s = encode_int8(w, method=method)
    for a, b in [(0, 1), (7, 9), (40, 150)]:
        qc, sc = encode_int8(w[a:b], method=method)
        assert torch.equal(qc, q[a:b]) and torch.equal(sc, s[a:b])


def test_fast_close_to_exact():
    w = _weights(256, 1536, seed=7)
    q, s = encode_int8(w)
    qf, sf = encode_int8(w, method="fast")
    assert (q.int() - qf.int()).abs().max() <= 1
    torch.testing.assert_close(sf, s, rtol=1e-6, atol=0)


# --- activations -----------------------------------------------------------------------------

def test_quantize_activation_rows():
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    x[2] = 0
    qx, sx = quantize_activation(x)
    assert qx.dtype == torch.int8 and qx.shape == (5, 96) and sx.shape == (5,) and sx.dtype == torch.float32
    xf = x.float()
    ref_s = (xf.abs().amax(1) / 127).clamp(min=1e-30)
    assert torch.equal(sx, ref_s)
    assert torch.equal(qx, torch.round(xf / ref_s[:, None]).to(torch.int8))
    assert not qx[2].any()


def test_quantize_activation_rejects():
    with pytest.raises(FormatError):
        quantize_activation(torch.randn(2, 3, 4))
    with pytest.raises(FormatError):
        quantize_activation(torch.zeros(2, 0))


# --- comfy-kitchen oracle: bit-exact codes and scales ----------------------------------------

def _kitchen(w: torch.Tensor, **kw):
    ck = pytest.importorskip("comfy_kitchen.tensor")
    qt = ck.QuantizedTensor.from_float(w.float(), "TensorWiseINT8Layout", **kw)
    return qt, qt._qdata, qt.params.scale


@pytest.mark.parametrize("n, k, g", [(512, 1536, 256), (96, 1024, 1024), (200, 256, 64),
                                     (160, 64, 16), (300, 16, 4), (13, 512, 256)])
@pytest.mark.parametrize("method", ["exact", "dense"])
def test_kitchen_convrot_bit_exact(n, k, g, method):
    w = _weights(n, k, seed=n + k)
    qt, qk, sk = _kitchen(w, per_channel=True, convrot=True, convrot_groupsize=g)
    q, s = encode_int8(w, group_size=g, method=method)
    assert torch.equal(q, qk)
    assert torch.equal(s, sk.reshape(n, 1))
    assert torch.equal(decode_int8(q, s, convrot=True, group_size=g), qt.dequantize())


def test_kitchen_fast_close():
    w = _weights(512, 1536, seed=9)
    _, qk, sk = _kitchen(w, per_channel=True, convrot=True, convrot_groupsize=256)
    q, s = encode_int8(w, method="fast")
    assert (q.int() - qk.int()).abs().max() <= 1
    torch.testing.assert_close(s, sk.reshape(-1, 1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("per_row", [True, False])
def test_kitchen_plain_bit_exact(per_row):
    w = _weights(64, 320, seed=11)
    qt, qk, sk = _kitchen(w, per_channel=per_row)
    q, s = encode_int8(w, convrot=False, per_row=per_row)
    assert torch.equal(q, qk)
    assert torch.equal(s, sk.reshape(s.shape))
    assert torch.equal(decode_int8(q, s, convrot=False), qt.dequantize())
