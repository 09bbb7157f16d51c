"""The factorisation in place (``gptq.inverse_factor``) gives the factor of the same steps run
with a fresh buffer each, written out here, bit for bit: at a width where a row-major
triangular-solve output was seen to change the last bits (K = 4096), for a symmetric Hessian
and for one in a rotated basis whose two triangles differ by rounding."""

from __future__ import annotations

import torch

from h3quant.calibration.gptq import inverse_factor
from h3quant.calibration.stats import LayerStats


def _fresh_buffers(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    hd = h.to(torch.float64).clone()
    dead = hd.diagonal() <= 0
    hd[dead, :] = 0.0
    hd[:, dead] = 0.0
    hd.diagonal()[dead] = 1.0
    hd.diagonal().add_(damp * float(hd.diagonal().mean()))
    lower = torch.linalg.cholesky(hd)
    li = torch.linalg.solve_triangular(lower, torch.eye(h.shape[0], dtype=torch.float64),
                                       upper=False)
    return torch.linalg.cholesky(li.t() @ li, upper=True).to(torch.float32)


def test_in_place_factor_equals_the_fresh_buffer_steps():
    k = 4096
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k + 64, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    x += 0.05 * torch.randn(k + 64, k, generator=g)
    x[:, 7] = 0.0  # a dead input
    h = x.t() @ x
    del x
    assert torch.equal(inverse_factor(h), _fresh_buffers(h))
    rotated = LayerStats.from_hessian("blocks.0.mlp.fc1", h, k).hessian(True, 256)
    assert torch.equal(inverse_factor(rotated), _fresh_buffers(rotated))
