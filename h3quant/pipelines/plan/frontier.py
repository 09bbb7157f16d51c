"""Size against whole-model SQNR: uniform files and planner files, predicted and measured.

Each point is a recipe. Predicted: the size from ``convert``'s header-only plan of that recipe
(exact) and the SQNR of the additive noise model. Measured: the recipe is converted for real
(to a temporary directory) and ``verify --model`` runs it against the float input on the same
seeded inputs the sensitivity pass used.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from h3quant.pipelines.plan.planner import FLOAT, Model, Prediction, choose, recipe_rules
from h3quant.pipelines.plan.sensitivity import (
    OUTPUTS,
    PlanError,
    Sensitivity,
    is_smoothed,
    split_calibrated,
)
from h3quant.sizes import MB


@dataclass
class Point:
    name: str  # "all-bf16", "all-int8-convrot", "plan >= 30 dB", ...
    target_sqnr: float | None
    rules: list[str]
    predicted_bytes: int
    predicted_sqnr_db: dict[str, float]
    measured_bytes: int | None = None
    measured_sqnr_db: dict[str, float] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)

    @property
    def predicted_min(self) -> float:
        return min(self.predicted_sqnr_db.values())

    @property
    def measured_min(self) -> float | None:
        return min(self.measured_sqnr_db.values()) if self.measured_sqnr_db else None

    def to_dict(self) -> dict:
        return {"name": self.name, "target_sqnr_db": self.target_sqnr, "rules": self.rules,
                "formats": self.formats, "predicted_bytes": self.predicted_bytes,
                "predicted_sqnr_db": self.predicted_sqnr_db,
                "predicted_min_sqnr_db": self.predicted_min,
                "measured_bytes": self.measured_bytes,
                "measured_sqnr_db": self.measured_sqnr_db,
                "measured_min_sqnr_db": self.measured_min}


def planned_bytes(src, rules, calibration: str | None = None, smooth: str = "off") -> int:
    """The exact output size of converting ``src`` with ``rules`` (header-only plan; with
    ``calibration`` / ``smooth`` as convert records them in the header, which then lists its
    smoothed layers too: a few hundred bytes more)."""
    from h3quant.pipelines.convert import ConvertOptions, plan_convert

    with tempfile.TemporaryDirectory(prefix="h3quant-plan-") as d:
        return plan_convert(src, Path(d) / "o.safetensors",
                            ConvertOptions(layers=tuple(rules), report=False,
                                           calibration=calibration, smooth=smooth)).output_bytes


def measure_recipe(src, rules, sens: Sensitivity, workdir: str | os.PathLike | None = None,
                   *, mmap: bool = True, calibration: str | None = None
                   ) -> tuple[int, dict[str, float]]:
    """Convert ``src`` with ``rules`` (and ``calibration``'s statistics, as convert
    --calibration, with --smooth auto where the pass measured smoothed candidates) and verify
    the whole model against ``src``: (file bytes, output -> SQNR)."""
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.pipelines.verify.model import ModelInputs, verify_model

    if all(r.target is None for r in rules):  # every unit kept: the float file itself
        return os.path.getsize(src), {o: math.inf for o in OUTPUTS}
    with tempfile.TemporaryDirectory(prefix="h3quant-plan-", dir=workdir) as d:
        out = Path(d) / "point.safetensors"
        smooth = "auto" if calibration and any(map(is_smoothed, sens.formats)) else "off"
        convert(src, out, ConvertOptions(layers=tuple(rules), report=False, mmap=mmap,
                                         calibration=calibration, smooth=smooth))
        res = verify_model(out, reference=src, device="cpu", inputs=ModelInputs(**sens.inputs),
                           mmap=mmap)
        got = {o.name: o.sqnr_db for o in res.outputs if o.name in OUTPUTS}
        return out.stat().st_size, got


def default_targets(model: Model, count: int = 3) -> list[float]:
    """``count`` targets evenly inside the quality range of the uniform quantized files."""
    lows = [model.uniform(f).min_sqnr_db for f in model.sens.formats]
    lo, hi = min(lows), max(lows)
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo < 0.5:
        return [round(hi, 1)]
    return [round(lo + (hi - lo) * (i + 1) / (count + 1), 1) for i in range(count)]


def frontier(src, model: Model, targets: list[float] | None = None, *, margin: float = 0.0,
             measure: bool = True, workdir=None, mmap: bool = True,
             on_point=None, calibration: str | None = None) -> list[Point]:
    """The frontier points (uniform files, then one planner file per target, planned for
    ``target + margin``); ``calibration``: the statistics a pass with calibrated candidates
    was measured with (each point is converted with them)."""
    sens = model.sens
    if measure and calibration is None and any(split_calibrated(f)[1] for f in sens.formats):
        raise PlanError("the pass has calibrated candidates (+gptq): measuring the frontier "
                        "needs the same statistics (--calibration STATS)")
    preds: list[tuple[str, float | None, Prediction]] = [
        (f"all-{f}", None, model.uniform(f)) for f in [FLOAT, *sens.formats]]
    for t in targets if targets is not None else default_targets(model):
        preds.append((f"plan >= {t:g} dB", t, choose(model, target_sqnr=t + margin)))
    points = []
    for n, (name, target, pred) in enumerate(preds):
        rules = recipe_rules(sens, pred.assignment)
        point = Point(name, target, [r.text for r in rules], planned_bytes(src, rules),
                      pred.sqnr_db, formats=pred.counts())
        if measure:
            point.measured_bytes, point.measured_sqnr_db = measure_recipe(
                src, rules, sens, workdir, mmap=mmap, calibration=calibration)
        points.append(point)
        if on_point is not None:
            on_point(n + 1, len(preds))
    return points


def source_bytes(src) -> int:
    """The float input's size: a file's, or the ``.safetensors`` files of a folder."""
    if os.path.isfile(src):
        return os.path.getsize(src)
    return sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)
               if f.endswith(".safetensors"))


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats (smaller or equal size with a higher predicted SQNR),
    smallest first: predicted SQNR rises with size along them."""
    best = -math.inf
    out: list[Point] = []
    for p in sorted(points, key=lambda p: (p.predicted_bytes, -p.predicted_min)):
        if p.predicted_min > best:
            out.append(p)
            best = p.predicted_min
    return out


def predicted_frontier(src, *, inputs=None, formats=None, targets: int = 5,
                       mmap: bool = True, on_block=None) -> list[Point]:
    """The planner's predicted frontier of a float checkpoint, nothing converted: one
    sensitivity pass (``sensitivity.measure``, one streamed forward per candidate per block,
    on ``inputs``), the uniform files and ``targets`` planner files between them, the points
    no other point beats (``pareto``)."""
    from h3quant.pipelines.plan.sensitivity import DEFAULT_FORMATS, measure

    sens = measure(src, formats=formats or DEFAULT_FORMATS, inputs=inputs, mmap=mmap,
                   on_block=on_block)
    model = Model(sens, source_bytes(src))
    return pareto(frontier(src, model, default_targets(model, targets), measure=False,
                           mmap=mmap))


def plot(points: list[Point], plt) -> bytes:
    """Size (MB) against the worse output's SQNR, predicted and measured (matplotlib ``plt``):
    the PNG's bytes (the caller writes them through the output rules)."""
    import io

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for attr, label, marker in (("predicted_min", "predicted", "o"),
                                ("measured_min", "measured", "x")):
        xs, ys, names = [], [], []
        for p in points:
            y = getattr(p, attr)
            size = p.predicted_bytes if attr == "predicted_min" else p.measured_bytes
            if y is not None and math.isfinite(y) and size is not None:
                xs.append(size / MB)
                ys.append(y)
                names.append(p.name)
        ax.scatter(xs, ys, marker=marker, label=label)
        if attr == "predicted_min":
            for x, y, name in zip(xs, ys, names):
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("whole-model SQNR, worse of video/audio (dB)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=120, format="png")
    finally:
        plt.close(fig)
    return buf.getvalue()
