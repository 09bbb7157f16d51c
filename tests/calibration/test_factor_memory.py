"""The factorisation (``gptq.inverse_factor``: one Cholesky of the order-reversed Hessian and one
triangular solve, in place) gives the upper Cholesky factor of the damped Hessian's inverse,
computed here the long way (an explicit inverse, then Cholesky), to fp32 rounding: at K = 4096,
for a symmetric Hessian with a dead input and for one in a rotated basis whose two triangles
differ by rounding."""

from __future__ import annotations

import torch

from h3quant.calibration.gptq import inverse_factor
from h3quant.calibration.stats import LayerStats


def _damped(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    hd = h.to(torch.float64).clone()
    dead = hd.diagonal() <= 0
    hd[dead, :] = 0.0
    hd[:, dead] = 0.0
    hd.diagonal()[dead] = 1.0
    hd.diagonal().add_(damp * float(hd.diagonal().mean()))
    return hd


def _long_way(h: torch.Tensor) -> torch.Tensor:
    hd = _damped(h)
    hd = (hd + hd.t()) / 2  # the two triangles of a rotated H differ by rounding
    return torch.linalg.cholesky(torch.linalg.inv(hd), upper=True)


def _check(h: torch.Tensor) -> None:
    got = inverse_factor(h)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.triu()) and bool((got.diagonal() > 0).all())
    want = _long_way(h)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 1e-5, err
    # and it is what the feedback needs: U^T U (H + damping) = I
    ident = (got.double().t() @ got.double()) @ _damped(h)
    assert float((ident - torch.eye(h.shape[0], dtype=torch.float64)).abs().max()) < 1e-3


def test_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    k = 4096
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k + 64, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    x += 0.05 * torch.randn(k + 64, k, generator=g)
    x[:, 7] = 0.0  # a dead input
    h = x.t() @ x
    del x
    _check(h)
    _check(LayerStats.from_hessian("blocks.0.mlp.fc1", h, k).hessian(True, 256))


def test_a_factor_of_the_unreversed_order_fails_the_check():
    """The check above can fail: the lower factor's inverse without the reversal is no upper
    Cholesky factor of the inverse."""
    k = 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * k, k, generator=g)
    h = x.t() @ x
    lower = torch.linalg.cholesky(_damped(h))
    wrong = torch.linalg.inv(lower).t().triu().to(torch.float32)  # L^-T: upper, wrong factor
    want = _long_way(h)
    assert float((wrong.double() - want).abs().max() / want.abs().max()) > 1e-2
