"""What a conversion returns: the ``ConvertReport`` and the ``LayerFailures`` error.

Torch-free (``convert`` imports it before torch is loaded); the per-layer metrics themselves are
computed in ``convert.report``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from h3quant.errors import ConvertError
from h3quant.pipelines.convert.options import REPORT_ROWS, REPORT_TOKENS


class LayerFailures(ConvertError):
    """Some layers could not be converted; nothing was written."""

    exit_code = 1


@dataclass
class ConvertReport:
    """What ``convert`` did: the plan's fields (files, sizes, what each layer became), every
    layer's result (``metrics`` or ``error``), the error summary and the timing."""

    input: str
    output: str
    target: str
    preset: str
    group_size: int
    h3: bool
    identity: bool
    counts: dict[str, int]
    layers: list[dict]
    copied: dict
    dropped: list[str]
    repairs: list[str]
    warnings: list[str]
    files: list[dict]
    input_bytes: int
    output_bytes: int
    summary: dict
    metric_method: str
    elapsed_s: float
    input_mb_per_s: float | None
    layout: str = "canonical"  # int8 weight layout written: canonical [N, K] or npu [K, N]
    extra: dict = field(default_factory=dict)  # plan fields added later (kept in the JSON form)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**d, **self.extra}


def build_report(plan, results: dict[str, dict], elapsed: float) -> ConvertReport:
    """The report of a finished run of ``plan`` (a ``ConvertPlan``); ``results`` maps each
    layer run to its entry (``convert_layers`` has resolved the report workers' metrics)."""
    base = plan.to_dict()
    layers = [results.get(lp.name, lp.to_dict()) for lp in plan.layers]
    base["layers"] = layers
    base["summary"] = summarize(layers)
    base["metric_method"] = (f"rows: up to {REPORT_ROWS} evenly spaced rows per layer; "
                             f"activation: {REPORT_TOKENS} tokens, seeded N(0,1); runtime int8 "
                             "math via torch._int_mm")
    base["elapsed_s"] = round(elapsed, 3)
    base["input_mb_per_s"] = round(plan.input_bytes / 1e6 / elapsed, 1) if elapsed > 0 else None
    names = {f.name for f in fields(ConvertReport)} - {"extra"}
    return ConvertReport(**{k: v for k, v in base.items() if k in names},
                         extra={k: v for k, v in base.items() if k not in names})


def summarize(layers: list[dict]) -> dict:
    """Worst layer and mean / max errors over the layers that carry metrics."""
    rows = [d for d in layers if d.get("metrics")]
    if not rows:
        return {"layers": 0}
    rel = [d["metrics"]["weight_rel_l2"] for d in rows]
    out = [d["metrics"]["output_rel_l2"] for d in rows]
    sq = [d["metrics"]["sqnr_db"] for d in rows if math.isfinite(d["metrics"]["sqnr_db"])]
    worst = max(rows, key=lambda d: d["metrics"]["output_rel_l2"])
    summary = {
        "layers": len(rows),
        "worst_layer": worst["name"],
        "worst_output_rel_l2": worst["metrics"]["output_rel_l2"],
        "mean_weight_rel_l2": sum(rel) / len(rel), "max_weight_rel_l2": max(rel),
        "mean_output_rel_l2": sum(out) / len(out), "max_output_rel_l2": max(out),
        "mean_sqnr_db": sum(sq) / len(sq) if sq else math.inf,
    }
    # calibrated layers: the output SQNR over the statistics' inputs (and held-out inputs'),
    # what calibration improves, where the weight error above may grow
    cal = [c.get("output_sqnr_db") or {} for c in
           (d.get("calibration") for d in layers) if isinstance(c, dict)]
    for key in ("calibration", "heldout"):
        vals = [c[key] for c in cal if isinstance(c.get(key), (int, float))
                and math.isfinite(c[key])]
        if vals:
            summary[f"mean_output_sqnr_db_{key}"] = sum(vals) / len(vals)
            summary[f"output_sqnr_layers_{key}"] = len(vals)
    return summary
