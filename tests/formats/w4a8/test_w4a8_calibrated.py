"""W4A8 calibrated encode: group scales chosen during the feedback (lazy), the in-feedback
trial of neighbouring scales against a direct GPTQ loss, identity statistics' bytes, and
comfy-kitchen reading the calibrated tensors as the marker says."""

from __future__ import annotations

import pytest
import torch

from h3quant.calibration.gptq import inverse_factor, output_sqnr_db
from h3quant.calibration.stats import LayerStats
from h3quant.formats.w4a8.calibrated import encode_w4a8_calibrated, trial_loss
from h3quant.formats.w4a8.tensors import decode_w4a8, decode_w4a8_int8, encode_w4a8

from helpers.feedback_problems import direct_group_loss, layer_stats, lowrank_problem


_problem, _stats = lowrank_problem, layer_stats


def _raw(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_lazy_group_scales_lower_the_output_error():
    w, h = _problem()
    plain = output_sqnr_db(w, decode_w4a8(encode_w4a8(w)), h)
    static = encode_w4a8_calibrated(w, _stats(h), lazy=False)
    lazy = encode_w4a8_calibrated(w, _stats(h), trial=0)
    tried = encode_w4a8_calibrated(w, _stats(h), trial=2)
    e_static, e_lazy, e_tried = (output_sqnr_db(w, decode_w4a8(t), h)
                                 for t in (static, lazy, tried))
    assert e_static > plain + 10.0
    assert e_lazy > e_static + 0.3  # measured +0.75 dB
    assert e_tried > e_lazy + 0.3  # measured +0.67 dB
    rtn = encode_w4a8(w)
    # the codebook and the row scales stay the uncalibrated encoder's; static keeps every group
    # scale, the lazy encodes move some
    for t in (static, lazy, tried):
        assert torch.equal(t["weight_codebook"], rtn["weight_codebook"])
        assert torch.equal(t["weight_s_channel"], rtn["weight_s_channel"])
    assert torch.equal(_raw(static["weight_s_rel"]), _raw(rtn["weight_s_rel"]))
    moved = (_raw(tried["weight_s_rel"]) != _raw(rtn["weight_s_rel"])).float().mean()
    assert 0.05 < float(moved) < 0.95


@pytest.mark.parametrize("trial", [0, 2])
def test_identity_statistics_keep_the_plain_bytes(trial):
    w, _ = _problem(n=40, k=256, seed=3)
    ident = LayerStats.from_hessian("blocks.0.mlp.fc1", torch.eye(256) * 5.0, 10_000)
    rtn, cal = encode_w4a8(w), encode_w4a8_calibrated(w, ident, trial=trial)
    assert set(rtn) == set(cal)
    for key in rtn:
        assert torch.equal(_raw(cal[key]), _raw(rtn[key])), key


def _direct_group_loss(t, lv, h):
    """GPTQ over one group written out, each column rounded to its row's nearest level."""
    def nearest(v, j):
        return lv.double().gather(1, (v.unsqueeze(1) - lv.double()).abs().argmin(1, keepdim=True)).squeeze(1)

    return direct_group_loss(t, nearest, h)


def test_trial_loss_is_the_feedbacks_loss():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 16, generator=g) @ torch.randn(16, 16, generator=g)
    h = x.t() @ x + 0.1 * torch.eye(16)
    u = inverse_factor(h, damp=0.0)
    t = torch.randn(16, 30, generator=g) * 40  # 30 rows' groups, in row-scale units
    levels = [torch.sort(torch.randint(-127, 128, (30, 16), generator=g).float(), 1).values
              for _ in range(3)]
    got = trial_loss(t, torch.stack(levels), u)
    for c, lv in enumerate(levels):
        want = _direct_group_loss(t, lv, h)
        torch.testing.assert_close(got[c].double(), want, rtol=2e-3, atol=1e-3)


def test_kitchen_reads_the_calibrated_tensors_as_we_do():
    pytest.importorskip("comfy_kitchen")
    import comfy_kitchen.tensor  # noqa: F401  (registers the layouts)
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout

    w, h = _problem(n=48, k=512, seed=9)
    t = encode_w4a8_calibrated(w, _stats(h), trial=2)
    params = AsymW4A8Int8Layout.Params(scale=t["weight_s_rel"], s_channel=t["weight_s_channel"],
                                       codebook=t["weight_codebook"], orig_dtype=torch.float32,
                                       orig_shape=tuple(w.shape))
    theirs = QuantizedTensor(t["weight"], "AsymW4A8Int8Layout", params).dequantize().float()
    ours = decode_w4a8(t)
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))
    from comfy_kitchen.backends.eager import w4a8_int8 as eager

    to_int8 = getattr(eager, "_dequant_int4_grouped_to_int8", None)
    if to_int8 is not None:  # private helper: the exact int8 grid the runtime multiplies
        w8 = to_int8(t["weight"], t["weight_s_rel"], t["weight_codebook"], 16)
        assert torch.equal(w8, decode_w4a8_int8(t["weight"], t["weight_s_rel"],
                                                codebook=t["weight_codebook"]))
