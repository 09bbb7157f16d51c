"""Small calibration problems for the 4-bit encoders' tests, and GPTQ over one group written
out directly (float64, explicit inverse Hessian, the OBS update), independent of h3quant."""

from __future__ import annotations

import torch


def lowrank_problem(n: int = 64, k: int = 512, seed: int = 0):
    """(weight [n, k], H [k, k]) of inputs with a rank-24 structure, noise and a few outlier
    channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 24, generator=g) @ torch.randn(24, k, generator=g)
    x += 0.3 * torch.randn(4096, k, generator=g)
    x[:, :8] *= 10  # a few outlier channels
    w = torch.randn(n, k, generator=g)
    return w, x.t() @ x


def layer_stats(h: torch.Tensor):
    """``h`` as one layer's statistics (4096 rows)."""
    from h3quant.calibration.stats import LayerStats

    return LayerStats.from_hessian("blocks.0.mlp.fc1", h, 4096)


def direct_group_loss(t: torch.Tensor, rounding, h: torch.Tensor) -> torch.Tensor:
    """GPTQ over one group of columns ``t`` [G, n] written out: round column j with
    ``rounding(values [n] float64, j)``, add ``(t_j - q_j)^2 / Hinv_jj``, push the error onto
    the later columns with row j of the running inverse, remove column j from the inverse.
    Returns the loss per row, float64."""
    hinv = torch.linalg.inv(h.double())
    t = t.double().clone()
    loss = torch.zeros(t.shape[1], dtype=torch.float64)
    for j in range(t.shape[0]):
        err = t[j] - rounding(t[j], j)
        loss += err * err / hinv[j, j]
        t[j + 1:] -= (err / hinv[j, j]).unsqueeze(0) * hinv[j, j + 1:].unsqueeze(1)
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return loss
