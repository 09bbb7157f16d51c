"""The in-feedback loss of candidate group scales against GPTQ's loss written out directly."""

from __future__ import annotations

import torch

from h3quant.calibration.gptq import inverse_factor
from h3quant.formats.group_trial import group_loss


def _direct_loss(t: torch.Tensor, step: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """GPTQ over one group of columns, float64, with the explicit inverse Hessian updated after
    every column (the OBS update), each column rounded to the grid ``step`` (per row):
    ``sum_j err_j^2 / Hinv_jj``."""
    hinv = torch.linalg.inv(h.double())
    t = t.double().clone()
    loss = torch.zeros(t.shape[1], dtype=torch.float64)
    for j in range(t.shape[0]):
        q = torch.round(t[j] / step) * step
        err = t[j] - q
        loss += err * err / hinv[j, j]
        t[j + 1:] -= (err / hinv[j, j]).unsqueeze(0) * hinv[j, j + 1:].unsqueeze(1)
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return loss


def test_group_loss_is_the_feedbacks_loss_for_every_candidate():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 16, generator=g) @ torch.randn(16, 16, generator=g)
    h = x.t() @ x + 0.1 * torch.eye(16)
    u = inverse_factor(h, damp=0.0)
    t = torch.randn(16, 25, generator=g) * 3
    steps = torch.rand(4, 25, generator=g) + 0.2  # 4 candidate grids, one step per row

    def rounding(v, jj):
        return torch.round(v / steps) * steps

    got = group_loss(t, u, rounding, 4)
    assert got.shape == (4, 25)
    for c in range(4):
        want = _direct_loss(t, steps[c].double(), h)
        torch.testing.assert_close(got[c].double(), want, rtol=2e-3, atol=1e-4)
    # a feedback-free loss (no error fed forward) is different: the test can tell them apart
    plain = ((t - torch.round(t / steps[0]) * steps[0]) / u.diagonal().unsqueeze(1)).pow(2).sum(0)
    assert not torch.allclose(plain.double(), _direct_loss(t, steps[0].double(), h), rtol=1e-2)


def test_group_loss_leaves_the_columns_alone():
    t = torch.randn(16, 5)
    before = t.clone()
    group_loss(t, torch.eye(16), lambda v, jj: v.round(), 3)
    assert torch.equal(t, before)
