"""Choose per-unit formats from a sensitivity pass, predict the result, write the recipe.

The prediction (docs/plan.md): each unit quantized alone puts noise energy ``N_o(u, f)`` on
output ``o`` (video, audio). Quantization errors of different blocks are treated as
independent, so their energies add: a file with unit ``u`` in format ``f_u`` is predicted to
have ``SQNR_o = 10 log10(S_o / sum_u N_o(u, f_u))`` on each output (``S_o``: the float output's
energy), and its quality is the worse of the two. The size of a unit in a format is exact (the
codec's planned tensors); the file size is the float input's minus what the units replace.

``choose`` is a greedy search over the units' options, ordered smallest first:

* ``target_sqnr``: start from the smallest format everywhere; while the predicted quality is
  below the target, take the upgrade (a unit to any larger option) that removes the most
  normalised excess noise per added byte; then try to step back down every unit whose
  saving keeps the target (largest saving first).
* ``max_size``: start from the smallest format everywhere (refused when even that is too big);
  take the upgrade with the largest drop of normalised noise per added byte that still fits,
  until none fits; a uniform file (one candidate everywhere) that fits and has less normalised
  noise replaces the result, so a size budget never gets a mix worse than the best single
  format within it (the greedy search is no exhaustive one).

``reasons`` says per unit why it got its format, in figures: each option's size and the
whole-model SQNR with that unit alone in it, and the planned file's predicted SQNR and size
with the unit in each other option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from h3quant.pipelines.plan.sensitivity import (
    OUTPUTS,
    PlanError,
    Sensitivity,
    split_calibrated,
    sqnr_db,
    unit_pattern,
)

FLOAT = "bf16"  # the unquantized option of a unit (kept as stored in the float input)


@dataclass
class Prediction:
    assignment: dict[str, str]  # unit -> format (FLOAT: kept)
    sqnr_db: dict[str, float]  # output -> predicted SQNR
    bytes: int  # predicted file size

    @property
    def min_sqnr_db(self) -> float:
        return min(self.sqnr_db.values())

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.assignment.values():
            out[f] = out.get(f, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"sqnr_db": dict(self.sqnr_db), "min_sqnr_db": self.min_sqnr_db,
                "bytes": self.bytes, "formats": self.counts()}


@dataclass
class Model:
    """The additive noise model over a sensitivity pass."""

    sens: Sensitivity
    input_bytes: int  # size of the float input file
    options: dict[str, list[str]] = field(default_factory=dict)  # unit -> formats, small first

    def __post_init__(self) -> None:
        table = self.sens.table()
        for unit, by in table.items():
            opts = sorted(by, key=lambda f: by[f].bytes)
            self.options[unit] = opts + [FLOAT]
        self._table = table

    def noise(self, unit: str, fmt: str) -> dict[str, float]:
        if fmt == FLOAT:
            return {o: 0.0 for o in OUTPUTS}
        return self._table[unit][fmt].noise

    def size(self, unit: str, fmt: str) -> int:
        r = next(iter(self._table[unit].values()))
        return r.float_bytes if fmt == FLOAT else self._table[unit][fmt].bytes

    def predict(self, assignment: dict[str, str]) -> Prediction:
        total = {o: 0.0 for o in OUTPUTS}
        nbytes = self.input_bytes
        for unit, fmt in assignment.items():
            for o, v in self.noise(unit, fmt).items():
                total[o] += v
            nbytes += self.size(unit, fmt) - self.size(unit, FLOAT)
        return Prediction(dict(assignment), {o: sqnr_db(self.sens.signal[o], total[o])
                                             for o in OUTPUTS}, nbytes)

    def uniform(self, fmt: str) -> Prediction:
        return self.predict({u: fmt for u in self.options})

    def smallest(self) -> dict[str, str]:
        return {u: opts[0] for u, opts in self.options.items()}


def _upgrades(model: Model, assign: dict[str, str]):
    """Every larger option of every unit: with many candidate formats the next larger one may
    be noisier (mxfp8 is larger than int8 ConvRot and, on some blocks, worse), and a search
    that looked only one step up would stop there short of a better, larger option."""
    for unit, fmt in assign.items():
        opts = model.options[unit]
        for up in opts[opts.index(fmt) + 1:]:
            yield unit, up


def choose(model: Model, *, target_sqnr: float | None = None,
           max_size: int | None = None) -> Prediction:
    """The assignment for a quality target or a size budget (see the module docstring)."""
    if (target_sqnr is None) == (max_size is None):
        raise PlanError("give exactly one of a target SQNR and a maximum size")
    assign = model.smallest()
    signal = model.sens.signal
    if target_sqnr is not None:
        budget = {o: signal[o] * 10 ** (-target_sqnr / 10) for o in OUTPUTS}

        def totals(a):
            t = {o: 0.0 for o in OUTPUTS}
            for u, f in a.items():
                for o, v in model.noise(u, f).items():
                    t[o] += v
            return t

        def meets(a) -> bool:
            t = totals(a)
            return all(t[o] <= budget[o] for o in OUTPUTS)

        while not meets(assign):
            t = totals(assign)
            over = [o for o in OUTPUTS if t[o] > budget[o]]
            best, best_score = None, -math.inf
            for unit, up in _upgrades(model, assign):
                cur = model.noise(unit, assign[unit])
                new = model.noise(unit, up)
                gain = sum(max(0.0, cur[o] - new[o]) / budget[o] for o in over)
                cost = max(1, model.size(unit, up) - model.size(unit, assign[unit]))
                score = gain / cost
                if gain > 0 and score > best_score:
                    best, best_score = (unit, up), score
            if best is None:  # nothing left to improve (every unit float: cannot happen)
                raise PlanError(f"no choice of formats reaches {target_sqnr} dB")
            assign[best[0]] = best[1]
        # step back down where the target still holds, largest saving first
        for unit in sorted(assign, key=lambda u: -(model.size(u, assign[u])
                                                   - model.size(u, model.options[u][0]))):
            opts = model.options[unit]
            for fmt in opts[:opts.index(assign[unit])]:
                trial = dict(assign, **{unit: fmt})
                if meets(trial):
                    assign = trial
                    break
        return model.predict(assign)
    assert max_size is not None  # exactly one of the two was given
    pred = model.predict(assign)
    if pred.bytes > max_size:
        raise PlanError(f"even the smallest choice ({assign and next(iter(assign.values()))} "
                        f"everywhere) is {pred.bytes:,} bytes, over --max-size {max_size:,}")
    chosen = _greedy_size(model, assign, pred, max_size)
    for fmt in model.sens.formats:
        uni = model.uniform(fmt)
        if uni.bytes <= max_size and objective(model, uni) < objective(model, chosen):
            chosen = uni
    return chosen


def objective(model: Model, pred: Prediction) -> float:
    """What ``max_size`` minimises: the noise energies over the float output's, summed over
    the outputs."""
    total = {o: 0.0 for o in OUTPUTS}
    for unit, fmt in pred.assignment.items():
        for o, v in model.noise(unit, fmt).items():
            total[o] += v
    return sum(total[o] / model.sens.signal[o] for o in OUTPUTS)


def _greedy_size(model: Model, assign: dict[str, str], pred: Prediction,
                 max_size: int) -> Prediction:
    signal = model.sens.signal
    while True:
        best, best_score = None, -math.inf
        for unit, up in _upgrades(model, assign):
            extra = model.size(unit, up) - model.size(unit, assign[unit])
            if pred.bytes + extra > max_size:
                continue
            cur, new = model.noise(unit, assign[unit]), model.noise(unit, up)
            gain = sum((cur[o] - new[o]) / signal[o] for o in OUTPUTS)
            score = gain / max(1, extra)
            if gain > 0 and score > best_score:
                best, best_score = (unit, up), score
        if best is None:
            return pred
        assign[best[0]] = best[1]
        pred = model.predict(assign)


def reasons(model: Model, pred: Prediction, *, max_size: int | None = None,
            target_sqnr: float | None = None) -> dict[str, dict]:
    """unit -> why it got its format: ``why`` (one line) and ``options`` (each option's bytes,
    the whole-model SQNR with this unit alone in it (``alone_sqnr_db``, None for float), and
    the planned file's predicted worse-output SQNR and size with this unit in that option).
    ``max_size`` / ``target_sqnr``: the plan's budget or target, to say which options break it."""
    from h3quant.sizes import size_text

    table = model.sens.table()
    out: dict[str, dict] = {}
    for unit, fmt in pred.assignment.items():
        options: dict[str, dict] = {}
        alts: list[str] = []
        for opt in model.options[unit]:
            trial = pred if opt == fmt else model.predict({**pred.assignment, unit: opt})
            alone = table[unit].get(opt)
            options[opt] = {"bytes": model.size(unit, opt),
                            "alone_sqnr_db": None if alone is None else
                            round(alone.min_sqnr_db, 3),
                            "file_min_sqnr_db": round(trial.min_sqnr_db, 3),
                            "file_bytes": trial.bytes}
            if opt == fmt:
                continue
            broken = []
            if max_size is not None and trial.bytes > max_size:
                broken.append("over the size budget")
            if target_sqnr is not None and trial.min_sqnr_db < target_sqnr:
                broken.append("below the target")
            delta = trial.bytes - pred.bytes
            alts.append(f"as {opt}: file {trial.min_sqnr_db:.2f} dB, "
                        f"{'+' if delta >= 0 else '-'}{size_text(abs(delta))}"
                        + (f" ({', '.join(broken)})" if broken else ""))
        mine = options[fmt]
        here = ("kept as stored" if fmt == FLOAT else
                f"{mine['alone_sqnr_db']:.2f} dB with only this unit quantized")
        out[unit] = {"format": fmt, "options": options,
                     "why": f"{fmt} ({here}, {size_text(mine['bytes'])}); file "
                            f"{pred.min_sqnr_db:.2f} dB, {size_text(pred.bytes)}; "
                            + "; ".join(alts) + _speed_note(fmt)}
    return out


def _speed_note(fmt: str) -> str:
    """What a format option that changes speed, not size, costs (INT4 ConvRot linear=int8)."""
    if fmt == FLOAT:
        return ""
    from h3quant.formats import registry
    from h3quant.pipelines.convert.recipe import parse_format

    target, opts = parse_format(split_calibrated(fmt)[0])
    if target is None or opts.get("linear_dtype") != "int8":
        return ""
    note = registry.target_codec(target).spec.encoding.linear_dtype_cost
    return f" ({note})" if note else ""


def recipe_rules(sens: Sensitivity, assignment: dict[str, str]):
    """The recipe rules giving each unit its format (one rule per format; float units: keep).
    A calibrated candidate (``w4a8+gptq``) is its plain format here: convert writes it
    calibrated when given the statistics (``--calibration``), which ``calibrated_formats``
    tells."""
    from h3quant.pipelines.convert.recipe import Rule, parse_format

    by: dict[str, list[str]] = {}
    for unit, fmt in assignment.items():
        by.setdefault(fmt, []).append(unit)
    rules = []
    for fmt in sorted(by, key=lambda f: (f != FLOAT, f)):
        pats = [unit_pattern(sens.prefix, u)[1:] for u in by[fmt]]  # drop each "^"
        pattern = "^(" + "|".join(pats) + ")" if len(pats) > 1 else "^" + pats[0]
        if fmt == FLOAT:
            rules.append(Rule(pattern, None))
        else:
            target, opts = parse_format(split_calibrated(fmt)[0])
            rules.append(Rule(pattern, target, opts.get("group_size"), None,
                              opts.get("linear_dtype")))
    return tuple(rules)


def calibrated_formats(assignment: dict[str, str]) -> list[str]:
    """The calibrated candidates (``+gptq``) an assignment uses: its recipe reproduces them
    only when converted with the same statistics (``convert --recipe R --calibration S``)."""
    return sorted({f for f in assignment.values() if split_calibrated(f)[1]})
