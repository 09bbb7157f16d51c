"""A plan for a real file: the planner's choice, sized as convert would write it.

``choose`` counts the tensors. The file also has a header: each layer's marker and, when the
plan smooths layers, the list of them, a few kB in all. ``plan_file`` sizes each plan exactly
from the source's headers (``planned_bytes``, nothing converted) and, under a size budget,
plans again for the bytes the header took, until the whole file fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.pipelines.plan.frontier import planned_bytes
from h3quant.pipelines.plan.planner import (
    Model,
    PlanError,
    Prediction,
    calibrated_formats,
    choose,
    recipe_rules,
    smoothing_room,
)
from h3quant.pipelines.plan.sensitivity import is_smoothed

ATTEMPTS = 4  # the header's size barely moves between plans: one or two are the rule


@dataclass(frozen=True)
class FilePlan:
    """The chosen assignment and what converting it takes and writes."""

    prediction: Prediction
    rules: tuple  # the recipe's rules, in order
    calibrated: list[str]  # calibrated candidates used: convert needs the same statistics
    smooth: str  # "auto" where a smoothed candidate is used, else "off"
    file_bytes: int  # the converted file's exact size, but for the list of smoothed layers
    header_room: int  # the most bytes that list can add

    @property
    def whole_bytes(self) -> int:
        """The converted file's size at most, its whole header included."""
        return self.file_bytes + self.header_room

    def tensor_budget(self, max_size: int | None) -> int | None:
        """The bytes ``max_size`` leaves the tensors, once this plan's header is counted."""
        return None if max_size is None else max_size - (self.whole_bytes - self.prediction.bytes)


def plan_file(src, model: Model, *, max_size: int | None = None,
              target_sqnr: float | None = None, calibration: str | None = None) -> FilePlan:
    """The plan ``choose`` makes for ``target_sqnr`` or ``max_size``, sized from ``src``'s
    headers; under ``max_size`` the whole file, header included, fits (PlanError if no plan
    does). ``calibration`` is the statistics file a calibrated candidate converts with."""
    budget = max_size
    whole = 0
    for _ in range(ATTEMPTS):
        try:
            pred = choose(model, max_size=budget, target_sqnr=target_sqnr)
        except PlanError:
            if max_size is None or budget is None or budget == max_size:
                raise
            raise PlanError(f"no plan fits --max-size {max_size:,} bytes with its header: the "
                            f"header takes {max_size - budget:,} bytes, and even the smallest "
                            f"choice's tensors are over the {budget:,} bytes left") from None
        plan = _sized(src, model, pred, calibration)
        whole = plan.whole_bytes
        if max_size is None or budget is None or whole <= max_size:
            return plan
        budget -= whole - max_size
    raise PlanError(f"no plan fits --max-size {max_size:,} bytes with its header (the last "
                    f"planned file was up to {whole:,} bytes)")


def _sized(src, model: Model, pred: Prediction, calibration: str | None) -> FilePlan:
    rules = recipe_rules(model.sens, pred.assignment)
    calibrated = calibrated_formats(pred.assignment)
    smooth = "auto" if any(map(is_smoothed, calibrated)) else "off"
    exact = planned_bytes(src, rules, calibration if calibrated else None,
                          smooth if calibration else "off")
    room = smoothing_room(model.sens, pred.assignment) if calibration else 0
    return FilePlan(pred, rules, calibrated, smooth, exact, room)
