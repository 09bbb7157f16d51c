"""The gated residual rounds once in a reduced-precision stream, as the reference's fused
``addcmul_`` does; the fp32 forward is unchanged.

The oracle is written here: the gate row cast to the stream dtype, then ``x + g * u`` formed in
fp32 (the product of two bf16 values is exact there) and rounded once. The old form rounded
the product to bf16 and then the sum: the tests check that form differs, so they can fail.
"""

from __future__ import annotations

import pytest
import torch

from h3quant.runtime.model import H3Model
from h3quant.runtime.model import ops

SIGMA = 0.45


def _once(x, gate, update, segments):
    """Test-side oracle: one rounding of ``x + g * u`` per segment."""
    out = x.clone()
    for a, b, row in segments:
        g = gate[row].to(x.dtype).float()
        out[a:b] = (x[a:b].float() + g * update[a:b].float()).to(x.dtype)
    return out


def _twice(x, gate, update, segments):
    """The double-rounded form: product rounded to x's dtype, then the sum."""
    out = x.clone()
    for a, b, row in segments:
        out[a:b] = x[a:b] + gate[row].to(x.dtype) * update[a:b].to(x.dtype)
    return out


def _case(dtype, seed=0, rows=64, hidden=256):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    u = torch.randn(rows, hidden, generator=g).to(dtype)
    gate = torch.randn(3, hidden, generator=g)  # fp32 rows, as a curve-form adaLN gives
    return x, gate, u, [(0, 20, 0), (20, 41, 2), (41, rows, 1)]


def test_bf16_gated_residual_rounds_once():
    x, gate, u, segs = _case(torch.bfloat16)
    got = ops.gated_residual(x, gate, u, segs)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _once(x, gate, u, segs))
    # the reference op itself: x.addcmul_(u, g) per segment
    ref = x.clone()
    for a, b, row in segs:
        ref[a:b].addcmul_(u[a:b], gate[row].to(x.dtype))
    assert torch.equal(got, ref)
    # the double-rounded form differs on a visible share of the elements
    old = _twice(x, gate, u, segs)
    assert (old != got).float().mean().item() > 0.01
    # x is not modified
    assert not torch.equal(got, x)


def test_fp32_gated_residual_is_unchanged():
    x, gate, u, segs = _case(torch.float32, seed=3)
    assert torch.equal(ops.gated_residual(x, gate, u, segs), _twice(x, gate, u, segs))


def test_fp32_update_is_not_rounded_before_the_sum():
    x, gate, u, segs = _case(torch.bfloat16, seed=5)
    uf = u.float() * 1.0001  # off the bf16 grid
    got = ops.gated_residual(x, gate, uf, segs)
    assert torch.equal(got, _once(x, gate, uf, segs))


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    path = tmp_path_factory.mktemp("round") / "pruned.safetensors"
    synth_checkpoint(path, preset="tiny", blocks=2, form="pruned", seed=7)
    return path


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 24, 2, 4, 6, generator=g)
    a = torch.randn(1, 32, 2, 3, generator=g)
    t = torch.randn(1, 5, 768, generator=g)
    return v.to(dtype), a.to(dtype), t.to(dtype)


def _err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.slow
def test_bf16_forward_equals_the_single_rounding_form_and_is_no_worse(float_file, monkeypatch):
    with H3Model.open(float_file) as m:
        fp32 = m(*_inputs(torch.float32), SIGMA)
        bf16 = m(*_inputs(torch.bfloat16), SIGMA)
        monkeypatch.setattr("h3quant.runtime.model.block.gated_residual", _once)
        oracle = m(*_inputs(torch.bfloat16), SIGMA)
        monkeypatch.setattr("h3quant.runtime.model.block.gated_residual", _twice)
        old = m(*_inputs(torch.bfloat16), SIGMA)
    for got, want in zip(bf16, oracle):
        assert torch.equal(got, want)
    for got, was, ref in zip(bf16, old, fp32):
        assert not torch.equal(got, was)
        assert _err(got, ref) <= _err(was, ref) * 1.05 + 1e-6
