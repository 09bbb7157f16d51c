"""AWQ's per-input-channel scaling: the search for ``s`` (the weight becomes ``W diag(s)``, its
inputs ``x / s``).

The layout stores no ``s``: the caller folds ``1 / s`` into whatever produces the layer's input
(for H3: the v rows of qkv_proj before out_proj, the up rows of fc1 before fc2). The output is
then unchanged in exact arithmetic, and the 4-bit levels are spent where the inputs are loud.

``search_channel_scale(w, stats)``: ``s = m ** alpha`` with ``m`` the mean ``|x|`` per input
channel (``stats.channel_absmean()``; without it the root mean square from ``diag H``), normalised by
``sqrt(max(s) min(s))``, for ``alpha`` on a grid of 20 values from 0 to 1. Each candidate is
encoded with this format's levels (the weighted clipping search, codes rounded to nearest) and
judged by the layer's output error ``tr(E H E^T)`` in the original basis (``E = W_hat / s - W``),
on at most ``SEARCH_ROWS`` (512) evenly spaced rows. The best candidate is then encoded as it will be
written (error feedback over the scaled statistics) and kept only if its output error is below
that of ``alpha = 0`` (no scaling) encoded the same way; ``alpha = 0`` gives ``s = 1`` exactly.

``stats`` is duck-typed (``calibration.stats.LayerStats``): ``hessian()``, ``rows``,
``channel_absmean()``, ``scaled(s)`` (the statistics of ``x / s``) and ``release()``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from h3quant.formats.awq_w4a16.encoder import GROUP, decode_awq_w4a16, encode_awq_w4a16

ALPHAS = 20  # alpha on linspace(0, 1, ALPHAS)
SEARCH_ROWS = 512  # rows the search encodes (evenly spaced); all rows of a smaller layer


def channel_magnitude(stats) -> torch.Tensor:
    """Mean |x| per input channel (fp64), from the statistics."""
    read = getattr(stats, "channel_absmean", None)
    a = read() if read is not None else getattr(stats, "absmean", None)
    if a is None or not torch.isfinite(a).all():
        h = stats.hessian()
        a = (h.diagonal().double().clamp(min=0) / max(int(stats.rows), 1)).sqrt()
    return a.double()


def scale_for(m: torch.Tensor, alpha: float) -> torch.Tensor:
    """``m ** alpha / sqrt(max * min)`` as fp32; ``alpha = 0``: ones exactly."""
    if alpha == 0.0:
        return torch.ones(m.shape[0], dtype=torch.float32)
    m = m.clamp(min=max(float(m.max()), 1e-30) * 1e-4)  # a silent channel: not an infinite 1/s
    s = m ** alpha
    s = s / math.sqrt(float(s.max()) * float(s.min()))
    return s.float()


def _sample(n: int) -> torch.Tensor:
    if n <= SEARCH_ROWS:
        return torch.arange(n)
    return torch.linspace(0, n - 1, SEARCH_ROWS, dtype=torch.float64).round().long().unique()


def _energy(e: torch.Tensor, h: torch.Tensor) -> float:
    """``tr(E H E^T)``: the product in fp32 (the cost), the sum in fp64."""
    return float(((e @ h).double() * e.double()).sum())


def _output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    return _energy(w_hat.float() - w.float(), h)


def _sqnr(sig: float, err: float) -> float:
    return math.inf if err <= 0 else round(10.0 * math.log10(max(sig, 1e-300) / err), 3)


def search_channel_scale(w: torch.Tensor, stats, *, group_size: int = GROUP,
                         dtype: torch.dtype = torch.bfloat16, alphas: int = ALPHAS
                         ) -> tuple[torch.Tensor | None, Any, dict]:
    """(``s`` fp32 [K] or None when no scaling beats none, the statistics of ``x / s`` (their
    error-feedback factor already computed: the encoder of the whole layer reuses it) or None,
    the search's figures)."""
    idx = _sample(w.shape[0])
    ws = w[idx].float()
    h = stats.hessian().float()
    diag = h.diagonal().double()
    m = channel_magnitude(stats)
    sig = _energy(ws, h)
    best_alpha, best_err = 0.0, math.inf
    for alpha in torch.linspace(0.0, 1.0, alphas).tolist():
        s = scale_for(m, alpha)
        t = encode_awq_w4a16(ws * s, None, group_size=group_size, dtype=dtype,
                             importance=diag / (s.double() * s.double()))
        err = _output_error(ws, decode_awq_w4a16(t, group_size) / s, h)
        if err < best_err:
            best_alpha, best_err = alpha, err
    plain = decode_awq_w4a16(encode_awq_w4a16(ws, stats, group_size=group_size, dtype=dtype),
                             group_size)
    err0 = _output_error(ws, plain, h)
    sqnr = {"unscaled": _sqnr(sig, err0), "scaled": _sqnr(sig, err0)}
    info: dict[str, Any] = {"alpha": 0.0, "rows_searched": int(idx.numel()),
                            "output_sqnr_db": sqnr}
    if best_alpha == 0.0:
        return None, None, info
    s = scale_for(m, best_alpha)
    scaled = stats.scaled(s)
    t = encode_awq_w4a16(ws * s, scaled, group_size=group_size, dtype=dtype)
    err1 = _output_error(ws, decode_awq_w4a16(t, group_size) / s, h)
    info["searched_alpha"] = round(best_alpha, 4)
    if not err1 < err0:  # the written codes are no better with it: no scaling
        scaled.release()
        return None, None, info
    sqnr["scaled"] = _sqnr(sig, err1)
    info["alpha"] = round(best_alpha, 4)
    return s, scaled, info


__all__ = ["ALPHAS", "SEARCH_ROWS", "channel_magnitude", "scale_for", "search_channel_scale"]
