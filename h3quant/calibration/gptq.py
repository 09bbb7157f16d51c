"""GPTQ-class error feedback on a codec's own level set, in pure vectorised torch.

A linear's output error on inputs ``X`` (rows) for a weight error ``E`` is ``tr(E H E^T)`` with
``H = X^T X``. Rows of the weight are independent; within a row, GPTQ quantizes the columns one
after another and spreads each column's rounding error over the columns not yet quantized, the
spread that minimises the output error (the inverse Hessian's Cholesky factor gives it in
closed form). The codec has already chosen its scales (and, for W4A8, its codebook and group
scales): error feedback only chooses which of the codec's levels each weight takes.

    U = inverse_factor(H)                  # upper Cholesky factor of the damped inverse Hessian
    codes = feedback(x, U, quantize)       # quantize(v [n], j) -> (codes [n], values [n])

Columns are processed in blocks of ``BLOCK``: inside a block one column at a time (vector ops on
the ``n`` rows), between blocks one matrix product ``Err [n, B] @ U[B, rest]`` (the GEMM floor).

With ``H`` a multiple of the identity, ``U`` is diagonal, every update is an exact zero and the
result is round-to-nearest itself, bit for bit (the identity guard tests this for every codec).
"""

from __future__ import annotations

import contextlib
import math

import torch

BLOCK = 128  # columns per blocked update
DAMP = 0.01  # damping: this share of the mean diagonal is added to the diagonal


def damped(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """``H + damp * mean(diag H) * I`` in float64; dead inputs (zero diagonal) get a unit diagonal
    (their columns take no feedback and are rounded to nearest)."""
    h = h.to(torch.float64).clone()
    diag = h.diagonal()
    dead = diag <= 0
    if bool(dead.any()):
        h[dead, :] = 0.0
        h[:, dead] = 0.0
        diag[dead] = 1.0
    mean = float(diag.mean())
    diag.add_(damp * (mean if mean > 0 else 1.0))
    return h


def inverse_factor(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damping)^-1`` (``Hinv = U^T U``), fp32.

    Row ``j`` of ``U`` divided by ``U[j, j]`` is the optimal spread of column ``j``'s error over
    the columns after it; ``U[j, j]^2`` is the inverse Hessian of the columns ``j..`` at ``j``."""
    hd = damped(h, damp)
    lower = torch.linalg.cholesky(hd)
    # H^-1 = L^-T L^-1 through a triangular solve and a GEMM: LAPACK's potri (cholesky_inverse)
    # was measured 5-25x slower on a busy two-core machine
    eye = torch.eye(hd.shape[0], dtype=hd.dtype, device=hd.device)
    li = torch.linalg.solve_triangular(lower, eye, upper=False)
    hinv = li.t() @ li
    return torch.linalg.cholesky(hinv, upper=True).to(torch.float32)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """The per-column work on the CPU in one thread: a few small element-wise operations per
    column, too short to gain from a thread pool, which a busy machine turns into waits (on a
    loaded two-core machine the loop ran 30 times slower with two threads than with one). The
    results do not depend on it: element-wise arithmetic is the same in any thread count. The
    GEMM between column blocks keeps every thread."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def feedback(x: torch.Tensor, u: torch.Tensor, quantize, *, block: int = BLOCK):
    """Codes of ``x`` [n, K] (fp32, the codec's basis) chosen with error feedback.

    ``quantize(v, j)``: the codec's nearest level of column ``j``'s values ``v`` [n] -> (codes
    [n], dequantized values [n]). Returns the codes [n, K] (the dtype ``quantize`` gives).
    Works on the transpose (a column is a contiguous row): the in-block updates are contiguous
    rank-1 updates in place (``addr_``), the between-block one a single GEMM in place
    (``addmm_``): no temporary as large as the weight."""
    n, k = x.shape
    if u.shape != (k, k):
        raise ValueError(f"factor is {list(u.shape)}, the weight has K={k}")
    wt = x.t().to(torch.float32).contiguous()  # [K, n]: row j = column j of the weight
    u = u.to(device=wt.device, dtype=torch.float32)
    codes = None
    err = torch.empty(min(block, k), n, dtype=torch.float32, device=wt.device)
    for i1 in range(0, k, block):
        i2 = min(k, i1 + block)
        u1 = u[i1:i2, i1:i2]
        with _one_cpu_thread(wt.device):
            for jj in range(i2 - i1):
                v = wt[i1 + jj]
                c, q = quantize(v, i1 + jj)
                if codes is None:
                    codes = torch.empty(k, n, dtype=c.dtype, device=wt.device)
                codes[i1 + jj] = c
                e = torch.sub(v, q, out=err[jj]).div_(u1[jj, jj])
                if jj + 1 < i2 - i1:
                    wt[i1 + jj + 1:i2].addr_(u1[jj, jj + 1:], e, alpha=-1)
        if i2 < k:
            wt[i2:].addmm_(u[i1:i2, i2:].t(), err[:i2 - i1], alpha=-1)  # no [K, n] temporary
    assert codes is not None  # k > 0: at least one column was quantized
    return codes.t().contiguous()


def predicted_gain_db(h: torch.Tensor, damp: float = DAMP) -> float:
    """Predicted output-error gain of error feedback over rounding to nearest, in dB.

    Model: every column's rounding error is independent with the same variance ``sigma^2``.
    Rounding to nearest then costs ``sigma^2 tr(H)`` per row; GPTQ, whose column ``j`` error is
    compensated by the columns after it, costs ``sigma^2 sum_j 1 / U_jj^2`` (``U`` the factor of
    the damped inverse, ``1 / U_jj^2`` the Schur complement of the columns ``j..``; equivalently
    ``sum_j V_jj^2`` for ``H = V V^T`` with ``V`` upper triangular). The gain is
    ``10 log10(tr H / sum_j 1 / U_jj^2)``, both of the damped ``H`` (so white inputs predict
    exactly 0 dB). Optimistic where feedback pushes weights into a
    level set's clamp, and blind to activation quantization."""
    return gain_from_factor(float(damped(h, damp).diagonal().sum()), inverse_factor(h, damp))


def gain_from_factor(trace: float, u: torch.Tensor) -> float:
    """``predicted_gain_db`` from the damped ``tr H`` and the factor ``inverse_factor`` gave."""
    tr = trace
    after = float((1.0 / u.diagonal().to(torch.float64) ** 2).sum())
    if tr <= 0 or after <= 0:
        return 0.0
    return 10.0 * math.log10(tr / after)


def output_sqnr_db(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """``10 log10(tr(W H W^T) / tr(E H E^T))``: the SQNR of the layer's output over the inputs
    whose second moment is ``H`` (same basis as the weights), activations in float."""
    h = h.to(torch.float64)
    w = w.to(torch.float64)
    e = w_hat.to(torch.float64) - w
    sig = float(((w @ h) * w).sum())
    noise = float(((e @ h) * e).sum())
    if noise <= 0:
        return math.inf
    return 10.0 * math.log10(max(sig, 1e-300) / noise)


__all__ = ["BLOCK", "DAMP", "damped", "feedback", "gain_from_factor", "inverse_factor", "output_sqnr_db",
           "predicted_gain_db"]
