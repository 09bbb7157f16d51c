"""nvfp4 calibrated encode: block scales chosen during the feedback (lazy, with neighbouring
scales tried by the feedback's loss), blocks the feedback leaves alone, identity statistics'
bytes, and comfy-kitchen decoding the calibrated tensors as we do."""

from __future__ import annotations

import pytest
import torch

from h3quant.calibration.gptq import output_sqnr_db
from h3quant.formats.nvfp4.calibrated import encode_nvfp4_calibrated
from h3quant.formats.nvfp4.tensors import (BLOCK, block_scales, decode_nvfp4, encode_nvfp4,
                                           roundup)

from helpers.feedback_problems import layer_stats, lowrank_problem


_problem, _stats = lowrank_problem, layer_stats


def _decoded(t, n, k):
    return decode_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])[:n, :k]


def _grid(t, n, k):
    return block_scales(t["weight_scale"], roundup(n, BLOCK), roundup(k, BLOCK) // BLOCK)[:n]


def test_lazy_scales_beat_fixed_scales_and_the_trial_beats_the_formula():
    """Output SQNR under the statistics' H: rounding < fixed scales < lazy scales (the
    encoder's scale for the updated block) <= lazy with neighbours tried; the tensor scale is
    the uncalibrated one in every case."""
    w, h = _problem()
    n, k = w.shape
    rtn = encode_nvfp4(w)
    st = _stats(h)
    fixed = encode_nvfp4_calibrated(w, st, lazy=False)
    formula = encode_nvfp4_calibrated(w, st, trial=0)
    tried = encode_nvfp4_calibrated(w, st)
    assert torch.equal(fixed["weight_scale"].view(torch.uint8), rtn["weight_scale"].view(torch.uint8))
    for t in (fixed, formula, tried):
        assert torch.equal(t["weight_scale_2"], rtn["weight_scale_2"])
    db = {name: output_sqnr_db(w, _decoded(t, n, k), h)
          for name, t in (("rtn", rtn), ("fixed", fixed), ("formula", formula), ("tried", tried))}
    assert db["rtn"] + 3 < db["fixed"] < db["formula"] < db["tried"], db
    assert not torch.equal(_grid(tried, n, k), _grid(fixed, n, k))


def test_blocks_the_feedback_leaves_alone_keep_their_scales():
    """H block-diagonal: white over the first 256 inputs (no feedback there), correlated over
    the rest. The first 16 blocks keep the uncalibrated scales and codes; later blocks move."""
    w, h = _problem(k=512)
    n, k = w.shape
    h = h.clone()
    h[:256, :] = 0
    h[:, :256] = 0
    h[:256, :256] = torch.eye(256) * float(h.diagonal()[256:].mean())
    cal = encode_nvfp4_calibrated(w, _stats(h))
    rtn = encode_nvfp4(w)
    g_cal, g_rtn = _grid(cal, n, k), _grid(rtn, n, k)
    assert torch.equal(g_cal[:, :16], g_rtn[:, :16])
    assert torch.equal(_decoded(cal, n, k)[:, :256], _decoded(rtn, n, k)[:, :256])
    assert not torch.equal(g_cal[:, 16:], g_rtn[:, 16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_statistics_give_the_uncalibrated_bytes(dtype):
    w, _ = _problem(n=40, k=256, seed=3)
    w = w.to(dtype)
    rtn = encode_nvfp4(w)
    cal = encode_nvfp4_calibrated(w, _stats(torch.eye(256) * 3.0))
    for key in rtn:
        assert torch.equal(cal[key], rtn[key]) if cal[key].dim() == 0 else torch.equal(
            cal[key].view(torch.uint8), rtn[key].view(torch.uint8)), key


def test_kitchen_decodes_the_calibrated_tensors_as_we_do():
    ck = pytest.importorskip("comfy_kitchen")
    w, h = _problem(n=48, k=256, seed=4)
    cal = encode_nvfp4_calibrated(w, _stats(h))
    theirs = ck.dequantize_nvfp4(cal["weight"], cal["weight_scale_2"], cal["weight_scale"],
                                 torch.float32)
    ours = decode_nvfp4(cal["weight"], cal["weight_scale"], cal["weight_scale_2"])
    assert torch.equal(theirs, ours)
