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

Activation rounding (``aware_target``). Where the runtime quantizes a layer's inputs too, the
layer computes ``Xq Wq^T`` (``Xq`` the rounded, rotated inputs), not ``X Wq^T``, and the error
that matters is ``|X W^T - Xq Wq^T|^2``. With ``Hq = Xq^T Xq`` and the cross term
``C = X^T Xq``, its minimiser over every real ``V`` is ``V* = W C Hq^-1``, and because the
residual ``X W^T - Xq V*^T`` is orthogonal to ``Xq``'s columns,

    |X W^T - Xq Wq^T|^2 = |Xq (Wq - V*)^T|^2 + const,

which is GPTQ's objective with the Hessian ``Hq`` and the target ``V*`` in place of ``W``. With
damping ``lam`` (the term ``lam |V - W|^2`` added) the target is
``V = W (C + lam I)(Hq + lam I)^-1``, which is ``W`` itself when ``C == Hq`` (inputs the runtime
does not round): then ``aware_target`` returns ``W`` untouched, so the codes are the plain
feedback's bit for bit.
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
    h = h.to(torch.float64, copy=True)  # one copy, whatever the input's dtype
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
    the columns after it; ``U[j, j]^2`` is the inverse Hessian of the columns ``j..`` at ``j``.

    With ``J`` the order-reversing permutation and ``J H J = L L^T``, ``H^-1 = U^T U`` for
    ``U = J L^-1 J``, which is upper triangular with a positive diagonal: the same factor as
    Cholesky's of the explicit inverse (it is unique), from one Cholesky and one triangular
    solve instead of a Cholesky, a solve, a GEMM and a second Cholesky (2.3x faster at
    K = 4096, measured; results within fp32 rounding of the longer way, tested).

    Memory: at most two float64 ``K x K`` buffers at a time besides ``h`` (each step writes into
    the buffer it reads where torch allows it, and a buffer is dropped once used), plus the
    column-major copy Cholesky makes: 1.64 GB a buffer at K = 14336."""
    rev = damped(h, damp).flip(0, 1)  # J H J: a copy; the damped H is dropped at once
    torch.linalg.cholesky(rev, out=rev)
    li = _lower_inverse(rev)
    del rev
    return li.to(torch.float32).flip(0, 1)


def _lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``L^-1`` (float64) by a triangular solve into a new buffer."""
    # H^-1 = L^-T L^-1 through a triangular solve and a GEMM: LAPACK's potri (cholesky_inverse)
    # was measured 5-25x slower on a busy two-core machine
    # column-major, as torch lays out its own result: a row-major ``out`` was measured to take
    # another path whose last bits differ (K = 4096)
    li = torch.eye(lower.shape[0], dtype=lower.dtype, device=lower.device).mT
    return torch.linalg.solve_triangular(lower, li, upper=False, out=li)


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


def feedback(x: torch.Tensor, u: torch.Tensor, quantize, *, block: int = BLOCK, groups=None):
    """Codes of ``x`` [n, K] (fp32, the codec's basis) chosen with error feedback.

    ``quantize(v, j)``: the codec's nearest level of column ``j``'s values ``v`` [n] -> (codes
    [n], dequantized values [n]). Returns the codes [n, K] (the dtype ``quantize`` gives).
    ``groups``: ``(size, start)``, the codec's groups of ``size`` consecutive columns (``size``
    divides ``block``): when the sweep reaches a group's first column ``j``, ``start(cols, j)``
    sees the group's columns as the feedback has updated them so far (``cols`` [size, n], read
    only), so the codec can choose the group's scales then (GPTQ's lazy group parameters)
    before ``quantize`` is asked for its columns.
    Works on the transpose (a column is a contiguous row): the in-block updates are contiguous
    rank-1 updates in place (``addr_``), the between-block one a single GEMM in place
    (``addmm_``): no temporary as large as the weight."""
    n, k = x.shape
    if u.shape != (k, k):
        raise ValueError(f"factor is {list(u.shape)}, the weight has K={k}")
    size, start = groups if groups is not None else (0, None)
    if groups is not None and (size <= 0 or block % size or k % size):
        raise ValueError(f"group size {size} must divide the block {block} and K={k}")
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
                if start is not None and (i1 + jj) % size == 0:
                    start(wt[i1 + jj:i1 + jj + size], i1 + jj, u1[jj:jj + size, jj:jj + size])
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


def aware_target(x: torch.Tensor, c: torch.Tensor, hq: torch.Tensor, damp: float = DAMP
                 ) -> torch.Tensor:
    """The target ``x (C + lam I)(Hq + lam I)^-1`` (fp32 ``[n, K]``) that error feedback over
    ``Hq`` rounds when the inputs are rounded too (module text): ``x`` [n, K] the weight in the
    statistics' basis, ``c = X^T Xq`` and ``hq = Xq^T Xq`` [K, K]. ``lam`` and the dead inputs
    are ``damped``'s (the same damped ``Hq`` whose factor the feedback uses). ``c`` equal to
    ``hq`` returns ``x`` itself."""
    if torch.equal(c, hq):
        return x
    return aware_solve(x, *aware_system(c, hq, damp))


def aware_system(c: torch.Tensor, hq: torch.Tensor, damp: float = DAMP
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``C`` plus ``damped``'s additions to ``Hq``, the lower Cholesky factor of the
    damped ``Hq``), float64: what ``aware_solve`` needs, computed once per layer."""
    hq64 = hq.to(torch.float64)
    hd = damped(hq64, damp)
    # lam on the diagonal; an input that always rounds to zero (a dead row of Hq) keeps its
    # weight as the target, and the inputs it correlates with still take over its part
    cd = c.to(torch.float64) + (hd - hq64)
    return cd, torch.linalg.cholesky(hd)


def aware_solve(x: torch.Tensor, cd: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """``x cd (L L^T)^-1`` in float64, returned fp32 (``aware_system``'s pair)."""
    m = x.to(torch.float64) @ cd  # [n, K]
    return torch.cholesky_solve(m.t().contiguous(), lower).t().to(torch.float32).contiguous()


def aware_objective(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                    hq: torch.Tensor) -> float:
    """``|X W^T - Xq W_hat^T|^2`` from the statistics alone (float64):
    ``tr(W H W^T) - 2 tr(W C W_hat^T) + tr(W_hat Hq W_hat^T)``."""
    w, w_hat = w.to(torch.float64), w_hat.to(torch.float64)
    return float(((w @ h.to(torch.float64)) * w).sum()
                 - 2.0 * ((w @ c.to(torch.float64)) * w_hat).sum()
                 + ((w_hat @ hq.to(torch.float64)) * w_hat).sum())


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


def gains_and_noise(x: torch.Tensor, xq: torch.Tensor, h_diag: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gain ``a`` [K], noise energy ``v`` [K]) float64 of ``calibration.aware``'s model, from
    the sampled rows ``x`` and their rounding ``xq`` (same basis) and ``H``'s diagonal in that basis. A
    channel the sample never sees keeps ``a = 1``, ``v = 0``."""
    x64, q64 = x.to(torch.float64), xq.to(torch.float64)
    xx = (x64 * x64).sum(0)
    seen = xx > 0
    a = torch.ones_like(xx)
    a[seen] = (x64 * q64).sum(0)[seen] / xx[seen]
    e = q64 - x64 * a
    v = torch.zeros_like(xx)
    v[seen] = h_diag.to(torch.float64)[seen].clamp_min(0) * (e * e).sum(0)[seen] / xx[seen]
    return a, v


__all__ = ["BLOCK", "DAMP", "aware_objective", "gains_and_noise", "aware_solve", "aware_system", "aware_target",
           "damped", "feedback", "gain_from_factor", "inverse_factor", "output_sqnr_db",
           "predicted_gain_db"]
