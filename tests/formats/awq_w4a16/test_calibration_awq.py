"""AWQ W4A16 tensors from the statistics, read back by comfy-kitchen's own AWQ reference."""

import pytest
import torch

from h3quant.formats.awq_w4a16.encoder import decode_awq_w4a16, encode_awq_w4a16
from h3quant.calibration.gptq import output_sqnr_db
from h3quant.calibration.stats import LayerStats


def _case(seed=0, n=64, k=256, rank=16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(2048, rank, generator=g) @ torch.randn(rank, k, generator=g)
    x *= 1 + 5 * (torch.rand(k, generator=g) < 0.05)  # a few loud input channels
    return w, x.t() @ x


def test_kitchen_reads_our_tensors():
    eager = pytest.importorskip("comfy_kitchen.backends.eager.awq")
    w, h = _case()
    t = encode_awq_w4a16(w, LayerStats.from_hessian("blocks.0.mlp.fc1", h, 4096))
    eye = torch.eye(w.shape[1], dtype=torch.bfloat16)
    theirs = eager.gemv_awq_w4a16(eye, t["qweight"], t["wscales"], t["wzeros"], group_size=64)
    assert torch.equal(theirs.float().t(), decode_awq_w4a16(t).to(torch.bfloat16).float())


def test_identity_statistics_are_the_uncalibrated_tensors():
    w, _ = _case(1)
    plain = encode_awq_w4a16(w)
    ident = encode_awq_w4a16(w, LayerStats.from_hessian("blocks.0.mlp.fc1", torch.eye(256), 10**6))
    for key in plain:
        assert torch.equal(plain[key], ident[key]), key


def test_statistics_lower_the_output_error():
    w, h = _case(2)
    plain = decode_awq_w4a16(encode_awq_w4a16(w))
    cal = decode_awq_w4a16(encode_awq_w4a16(w, LayerStats.from_hessian("blocks.0.mlp.fc1", h,
                                                                        4096)))
    assert output_sqnr_db(w, cal, h) > output_sqnr_db(w, plain, h) + 3.0
