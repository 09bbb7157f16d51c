"""Choosing a group's scale inside error feedback: the feedback's own loss for several
candidate scales at once.

Error feedback (``h3quant.calibration.gptq.feedback``) calls a codec's group hook when its
sweep reaches the first column of a group of columns that share a scale. The hook sees the
group as the feedback has updated it and the group's block ``u`` of the inverse Hessian's
upper factor, and may try several scales: for each, the group's columns are rounded one after
another with the error of each fed forward inside the group, exactly as the sweep will do,
and the loss ``sum_j (e_j / u_jj)^2`` says which scale the sweep's objective prefers.
"""

from __future__ import annotations

import torch


def group_loss(cols: torch.Tensor, u: torch.Tensor, rounding, candidates: int) -> torch.Tensor:
    """The loss of ``candidates`` ways of rounding one group, per row: ``cols`` [G, n] the
    group's columns as the sweep has them, ``u`` [G, G] the group's block of the factor,
    ``rounding(v, jj)`` the values ``v`` [C, n] of column ``jj`` rounded under each candidate
    -> [C, n]. Returns [C, n] fp32."""
    g = cols.shape[0]
    v = cols.unsqueeze(0).repeat(candidates, 1, 1)  # [C, G, n], updated in place
    loss = torch.zeros(candidates, cols.shape[1], dtype=torch.float32, device=cols.device)
    for jj in range(g):
        e = (v[:, jj] - rounding(v[:, jj], jj)).div_(u[jj, jj])
        loss.addcmul_(e, e)
        if jj + 1 < g:
            v[:, jj + 1:].sub_(u[jj, jj + 1:].view(1, -1, 1) * e.unsqueeze(1))
    return loss


__all__ = ["group_loss"]
