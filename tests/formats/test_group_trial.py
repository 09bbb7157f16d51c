"""The in-feedback loss of candidate group scales against GPTQ's loss written out directly."""

from __future__ import annotations

import torch

from h3quant.calibration.gptq import inverse_factor
from h3quant.formats.group_trial import group_loss

from helpers.feedback_problems import direct_group_loss


def _direct_loss(t, step, h):
    """GPTQ over one group written out, each column rounded to its row's grid ``step``."""
    return direct_group_loss(t, lambda v, j: torch.round(v / step) * step, h)


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
