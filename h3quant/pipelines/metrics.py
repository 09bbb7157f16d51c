"""Error metrics shared by the convert report and verify: relative L2, SQNR (dB), cosine; and
the JSON form of results that may hold infinities."""

from __future__ import annotations

import math

import torch


def error_metrics(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """``(||got - ref|| / ||ref||, SQNR dB, cosine)`` of ``got`` against ``ref``, in float64.

    Degenerate cases: both zero -> (0, inf, 1); a zero reference with a non-zero error -> rel inf,
    SQNR -inf; any non-finite error -> (inf, -inf, nan).
    """
    g, r = got.double().flatten(), ref.double().flatten()
    err, norm = (g - r).norm().item(), r.norm().item()
    if not math.isfinite(err):
        return math.inf, -math.inf, float("nan")
    rel = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    sqnr = math.inf if rel == 0 else -20.0 * math.log10(rel)
    gn = g.norm().item()
    if norm > 0 and gn > 0:
        cos = (g @ r).item() / (norm * gn)
    else:
        cos = 1.0 if err == 0 else 0.0
    return rel, sqnr, cos


def json_safe(obj):
    """``obj`` with non-finite floats as strings ("inf", "nan"), for strict JSON output."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
