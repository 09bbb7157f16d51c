"""ConvRot Hadamard (FORMATS.md 3.1): the matrix, and the dense / exact / fast rotations."""

import functools

import numpy as np
import pytest
import torch

from h3quant.convrot import (
    GroupSizeError,
    check_group_size,
    hadamard,
    is_valid_group_size,
    rotate,
    rotate_dense,
    rotate_exact,
)
from h3quant.convrot.rotation import CHUNK_ELEMS, DENSE_MIN_ROWS, _rotate_halves, halves_match_dense
from h3quant.errors import FormatError

SIZES = [4, 16, 64, 256, 1024]
H4 = [[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]]


@functools.lru_cache(maxsize=None)
def _kron_reference(g: int) -> np.ndarray:
    """H_g from its definition, entrywise: prod over base-4 digits (i_d, j_d) of H4[i_d][j_d], / sqrt(g)."""
    k = int(round(np.log(g) / np.log(4)))
    idx = np.arange(g)
    digits = [(idx >> (2 * (k - 1 - d))) & 3 for d in range(k)]  # most significant first
    h4 = np.array(H4, dtype=np.float64)
    h = np.ones((g, g))
    for dig in digits:
        h *= h4[dig[:, None], dig[None, :]]
    return h / np.sqrt(g)


def _rot64(x: torch.Tensor, g: int) -> np.ndarray:
    xn = x.double().numpy()
    h = _kron_reference(g)
    return (xn.reshape(*xn.shape[:-1], -1, g) @ h).reshape(xn.shape)


@pytest.mark.parametrize("g", [4, 16, 64, 256, 1024, 4096])
def test_valid_group_sizes(g):
    assert is_valid_group_size(g)
    check_group_size(g)


@pytest.mark.parametrize("g", [0, 1, 2, 3, 8, 12, 32, 128, 512, 2048, -4, 4.0, True, "256", None])
def test_invalid_group_sizes(g):
    assert not is_valid_group_size(g)
    with pytest.raises(GroupSizeError):
        check_group_size(g)


def test_group_size_error_is_format_and_value_error():
    with pytest.raises(FormatError):
        check_group_size(8)
    with pytest.raises(ValueError):
        check_group_size(8)


@pytest.mark.parametrize("g", SIZES)
def test_matrix_properties(g):
    h = hadamard(g)
    assert h.dtype == torch.float32 and h.shape == (g, g)
    assert torch.equal(h, h.T)  # symmetric
    h64 = h.double()
    eye = torch.eye(g, dtype=torch.float64)
    assert torch.equal(h64 @ h64.T, eye)  # orthogonal (entries are +-2^-k: exact in float64)
    assert torch.equal(h64 @ h64, eye)  # involutory
    assert set(h.abs().unique().tolist()) == {1 / np.sqrt(g)}


@pytest.mark.parametrize("g", SIZES)
def test_matrix_equals_kronecker_definition(g):
    assert np.array_equal(hadamard(g).double().numpy(), _kron_reference(g).astype(np.float32))


def test_matrix_1024_equals_kron_of_smaller():
    ref = torch.kron(hadamard(256).double() * 16, hadamard(4).double() * 2)
    assert torch.equal(hadamard(1024).double() * 32, ref)


@pytest.mark.parametrize("g", SIZES)
def test_not_sylvester(g):
    scipy_linalg = pytest.importorskip("scipy.linalg")
    syl = torch.tensor(scipy_linalg.hadamard(g), dtype=torch.float32) / np.sqrt(g)
    assert not torch.equal(hadamard(g), syl)
    x = torch.randn(3, g)
    assert not torch.allclose(rotate_dense(x, g), x @ syl, atol=1e-3)


def test_h4_columns_are_not_signed_sylvester_columns():
    """Each H4 column has three equal signs, no Sylvester column does: no signed column
    permutation maps one matrix to the other."""
    scipy_linalg = pytest.importorskip("scipy.linalg")
    syl = scipy_linalg.hadamard(4)
    for c in np.array(H4).T:
        assert not any(np.array_equal(c, s * sc) for sc in syl.T for s in (1, -1))


@pytest.mark.parametrize("g", SIZES)
def test_dense_matches_float64(g):
    x = torch.randn(5, 2 * g)
    torch.testing.assert_close(rotate_dense(x, g).double(), torch.from_numpy(_rot64(x, g)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("g", SIZES)
@pytest.mark.parametrize("butterfly", [False, True])
def test_fast_equals_dense_to_fp32_rounding(g, butterfly):
    x = (torch.randn(37, 3 * g) * torch.exp(torch.randn(37, 3 * g))).bfloat16()
    dense = rotate_dense(x, g)
    fast = rotate(x, g, butterfly=butterfly)
    assert fast.dtype == torch.float32 and fast.shape == x.shape
    # any summation order of g exact terms is within ~g ulps of the block's absolute sum
    bound = 2 * g * 2.0 ** -24 * x.float().abs().reshape(37, 3, g).sum(-1, keepdim=True) / np.sqrt(g)
    diff = (fast - dense).abs().reshape(37, 3, g)
    assert bool((diff <= bound).all())
    assert not torch.equal(fast, torch.zeros_like(fast))


def test_fast_many_chunks_and_leading_dims():
    g = 256
    rows = CHUNK_ELEMS // 512 * 3 + 5  # several chunks plus a ragged one
    x = torch.randn(rows, 512)
    torch.testing.assert_close(rotate(x, g), rotate_dense(x, g), rtol=0, atol=1e-5)
    x3 = torch.randn(2, 3, 1024, dtype=torch.bfloat16)
    out = rotate(x3, g)
    assert out.shape == (2, 3, 1024) and out.dtype == torch.float32
    torch.testing.assert_close(out.reshape(6, 1024), rotate_dense(x3.reshape(6, 1024), g), rtol=0, atol=1e-5)


@pytest.mark.parametrize("g", SIZES)
def test_rotation_is_involutory(g):
    x = torch.randn(4, 2 * g)
    torch.testing.assert_close(rotate(rotate(x, g), g), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("g", [4, 16, 256])
def test_rotation_preserves_products(g):
    """(x H)(W H)^T == x W^T: the runtime rotates activations the same way as the weight."""
    x = torch.randn(3, 4 * g, dtype=torch.float64)
    w = torch.randn(5, 4 * g, dtype=torch.float64)
    lhs = rotate(x, g).double() @ rotate(w, g).double().T
    torch.testing.assert_close(lhs, x @ w.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("g", SIZES)
def test_exact_is_bit_identical_to_dense(g):
    x = torch.randn(300, 2 * g) * torch.exp(2 * torch.randn(300, 2 * g))
    x[:, ::3] *= -1e3
    assert torch.equal(rotate_exact(x, g), rotate_dense(x, g))


@pytest.mark.parametrize("g", [16, 64, 256, 1024])
def test_halves_close_to_dense(g):
    """The half-size matmul path is a correct rotation on any BLAS (bit-exactness is probed)."""
    x = torch.randn(DENSE_MIN_ROWS, 2 * g)
    torch.testing.assert_close(_rotate_halves(x, g), rotate_dense(x, g), rtol=0, atol=1e-5)


def test_halves_used_for_256_on_cpu():
    """Informational on MKL hosts: the half-size exact path is what makes exact encoding fast."""
    if not halves_match_dense(256):
        pytest.skip("this BLAS does not sum K=256 as two halves; rotate_exact falls back to dense")
    x = torch.randn(64, 512)
    assert torch.equal(rotate_exact(x, 256), rotate_dense(x, 256))


@pytest.mark.parametrize("rotate_fn", [rotate_dense, rotate_exact])
def test_row_results_do_not_depend_on_row_count(rotate_fn):
    x = torch.randn(200, 768) * torch.exp(2 * torch.randn(200, 768))
    full = rotate_fn(x, 256)
    for a, b in [(0, 1), (5, 8), (13, 200), (199, 200)]:
        assert torch.equal(rotate_fn(x[a:b], 256), full[a:b])


def test_dense_bit_identical_to_kitchen():
    pytest.importorskip("comfy_kitchen")
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight

    for g in [4, 16, 64, 256, 1024]:
        w = torch.randn(64, 2 * g) * torch.exp(torch.randn(64, 2 * g))
        ref = _rotate_weight(w, _build_hadamard(g), g)
        assert torch.equal(rotate_dense(w, g), ref), g
        assert torch.equal(rotate_exact(w, g), ref), g


@pytest.mark.parametrize("fn", [rotate, rotate_dense, rotate_exact])
@pytest.mark.parametrize("g, k", [(8, 16), (12, 24), (2, 4), (16, 100), (256, 128)])
def test_invalid_rotations_rejected(fn, g, k):
    with pytest.raises(GroupSizeError):
        fn(torch.randn(2, k), g)


def test_scalar_rejected():
    with pytest.raises(GroupSizeError):
        rotate(torch.tensor(1.0), 4)


def test_hadamard_device_argument():
    assert torch.equal(hadamard(16, "cpu"), hadamard(16))
    assert torch.equal(hadamard(16, torch.device("cpu")), hadamard(16))


@pytest.mark.parametrize("g,group", [(256, 16), (64, 16), (16, 16), (1024, 16), (256, 4), (256, 32)])
@pytest.mark.parametrize("shape", [(48, 6144), (7, 1024), (1, 2048)])
def test_group_major_rotation_is_the_transposed_rotation(g, group, shape):
    """``rotate_group_major`` = ``rotate(x).reshape(-1, group).t()`` bit for bit: the direct
    matmuls where the probe confirms them, else the fallback (the W4A8 encoder's bytes rest on
    it); the probe says yes for the default W4A8 layout on MKL."""
    from h3quant.convrot.rotation import group_major_matches, rotate_group_major

    n, k = shape
    gen = torch.Generator().manual_seed(n + k + g)
    x = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, k, generator=gen) * 2)
    want = rotate(x, g).reshape(-1, group).t()
    got = rotate_group_major(x.to(torch.bfloat16), g, group) if n == 7 else rotate_group_major(x, g, group)
    if n == 7:
        want = rotate(x.to(torch.bfloat16), g).reshape(-1, group).t()
    assert got.shape == (group, n * k // group) and got.is_contiguous()
    assert torch.equal(got, want)
    if torch.backends.mkl.is_available() and (g, group) == (256, 16):
        assert group_major_matches(g, group)


def test_group_major_probe_refuses_a_different_summation(monkeypatch):
    """A direct path that rounds differently is detected and not used."""
    from h3quant.convrot import rotation as R

    monkeypatch.setattr(R, "_GROUP_MAJOR_OK", {})
    real = R._group_major_mm
    monkeypatch.setattr(R, "_group_major_mm", lambda x, g, group: real(x, g, group) * (1 + 2**-20))
    assert not R.group_major_matches(256, 16)
    x = torch.randn(4, 512)
    assert torch.equal(R.rotate_group_major(x, 256, 16), rotate(x, 256).reshape(-1, 16).t())
