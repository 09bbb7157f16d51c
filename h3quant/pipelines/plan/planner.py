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
  until none fits; the same from the knapsack optimum (dynamic programming over the bytes each
  unit adds, in 65,536 steps of the budget, rounded up so that it fits), the better of the two
  kept; each then moves single units, or two at once (one down to pay for another up), while a
  move that fits lowers the normalised noise; a uniform file (one candidate
  everywhere) that fits and has less normalised noise replaces the result, so a size budget
  never gets a mix worse than the best single format within it (the search is no exhaustive
  one).

``reasons`` says per unit why it got its format, in figures: each option's size and the
whole-model SQNR with that unit alone in it, and the planned file's predicted SQNR and size
with the unit in each other option.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from h3quant.pipelines.plan.sensitivity import (
    OUTPUTS,
    PlanError,
    Sensitivity,
    is_smoothed,
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

    def cost(self, unit: str, fmt: str) -> float:
        """The unit's noise energies in ``fmt`` over the float outputs', summed over the
        outputs (what a size plan minimises, unit by unit)."""
        return sum(v / self.sens.signal[o] for o, v in self.noise(unit, fmt).items())

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
    if target_sqnr is not None:
        return _for_target(model, target_sqnr)
    assert max_size is not None  # exactly one of the two was given
    pred = model.predict(assign)
    if pred.bytes > max_size:
        raise PlanError(f"even the smallest choice ({assign and next(iter(assign.values()))} "
                        f"everywhere) is {pred.bytes:,} bytes, over --max-size {max_size:,}")
    if fold_ties(model):  # partners share a format: the knapsack alone moves them together
        chosen = _knapsack(model, max_size, _groups(model))
        if chosen is None:  # a pair's smallest common option is larger than its two smallest
            raise PlanError(f"even the smallest choice with each smoothing pair in one format "
                            f"is over --max-size {max_size:,}")
        return _best_uniform(model, chosen, max_size)
    chosen = _exchange(model, _greedy_size(model, assign, pred, max_size), max_size)
    exact = _knapsack(model, max_size)
    if exact is not None:
        exact = _exchange(model, _greedy_size(model, dict(exact.assignment), exact, max_size),
                          max_size)
        if objective(model, exact) < objective(model, chosen):
            chosen = exact
    return _best_uniform(model, chosen, max_size)


def _best_uniform(model: Model, chosen: Prediction, max_size: int) -> Prediction:
    """``chosen``, or a uniform file that fits with less normalised noise."""
    for fmt in model.sens.formats:
        uni = model.uniform(fmt)
        if uni.bytes <= max_size and objective(model, uni) < objective(model, chosen):
            chosen = uni
    return chosen


FOLD_PAIRS = (("attn.qkv_proj", "attn.out_proj"), ("mlp.fc1", "mlp.fc2"))


def fold_ties(model: Model) -> list[tuple[str, str]]:
    """The units a size plan must give one format together: with smoothed per-linear
    candidates, ``out_proj``'s smoothing factors are folded into ``qkv_proj``'s v rows (and
    ``fc2``'s into ``fc1``'s up rows). Each linear was measured with its partner smoothed for
    the same format, so a plan is predicted right only where partners share it; in a mix of
    two formats the folded rows would be those of the other format's factors (on a tiny
    synthetic H3 such a mix measured 1.2 dB under its prediction)."""
    if not model.sens.per_layer or not any(is_smoothed(f) for f in model.sens.formats):
        return []
    out = []
    for unit in model.options:
        parts = unit.split(".")  # blocks.N.attn.qkv_proj
        head, sub = ".".join(parts[:2]) + ".", ".".join(parts[2:])
        for a, b in FOLD_PAIRS:
            if sub == a and head + b in model.options:
                out.append((unit, head + b))
    return out


def _groups(model: Model) -> list[tuple[str, ...]]:
    """The units that move together (``fold_ties``' pairs, every other unit alone), in the
    order of ``model.options``."""
    tied = fold_ties(model)
    partner = dict(tied)
    return [(u, partner[u]) if u in partner else (u,) for u in model.options
            if u not in partner.values()]


def _group_options(model: Model, group: tuple[str, ...]) -> list[str]:
    """The options every unit of ``group`` has, smallest (together) first."""
    common = [f for f in model.options[group[0]] if all(f in model.options[u] for u in group)]
    return sorted(common, key=lambda f: _group_size(model, group, f))


def _group_size(model: Model, group: tuple[str, ...], fmt: str) -> int:
    return sum(model.size(u, fmt) for u in group)


def _for_target(model: Model, target_sqnr: float) -> Prediction:
    """``choose`` for a quality target: upgrade the unit (or tied pair) that removes the most
    normalised excess noise per added byte until the target holds, then step each back down
    where the target still holds (largest saving first)."""
    signal = model.sens.signal
    budget = {o: signal[o] * 10 ** (-target_sqnr / 10) for o in OUTPUTS}
    groups = _groups(model)
    opts = {g: _group_options(model, g) for g in groups}
    assign = {u: opts[g][0] for g in groups for u in g}

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
        for g in groups:
            cur_f = assign[g[0]]
            for up in opts[g][opts[g].index(cur_f) + 1:]:
                change = {o: sum(model.noise(u, cur_f)[o] - model.noise(u, up)[o] for u in g)
                          for o in OUTPUTS}
                gain = sum(max(0.0, change[o]) / budget[o] for o in over)
                cost = max(1, _group_size(model, g, up) - _group_size(model, g, cur_f))
                score = gain / cost
                if gain > 0 and score > best_score:
                    best, best_score = (g, up), score
        if best is None:  # nothing left to improve (every unit float: cannot happen)
            raise PlanError(f"no choice of formats reaches {target_sqnr} dB")
        assign.update({u: best[1] for u in best[0]})
    # step back down where the target still holds, largest saving first
    def saving(g) -> int:
        return _group_size(model, g, assign[g[0]]) - _group_size(model, g, opts[g][0])

    for g in sorted(groups, key=lambda g: -saving(g)):
        for fmt in opts[g][:opts[g].index(assign[g[0]])]:
            trial = dict(assign, **{u: fmt for u in g})
            if meets(trial):
                assign = trial
                break
    return model.predict(assign)


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


def _knapsack(model: Model, max_size: int, groups: list[tuple[str, ...]] | None = None,
              bins: int = 1 << 16) -> Prediction | None:
    """The size plan that minimises the normalised noise, by dynamic programming over the
    bytes each unit adds above its smallest option (a multiple-choice knapsack; the objective
    adds per unit). The budget above the smallest file is cut into ``bins`` steps and each
    option's added bytes are rounded up to whole steps, so the plan always fits; it can miss
    the optimum by at most one step per unit of unused room, which ``_greedy_size`` and
    ``_exchange`` then use where no units are tied (they move units one at a time, so a tied
    plan keeps the knapsack's). ``groups``: the units that take one format together (``_groups``;
    each group one item of the knapsack, its options those all its units have); default,
    every unit alone. None when even the smallest file does not fit."""
    import numpy as np

    items = groups or [(u,) for u in model.options]
    opts = {it: _group_options(model, it) for it in items}

    def cost(item, f) -> float:
        return sum(model.cost(u, f) for u in item)

    size = functools.partial(_group_size, model)
    base = {it: size(it, opts[it][0]) for it in items}
    room = max_size - (model.input_bytes + sum(base[it] - size(it, FLOAT) for it in items))
    if room < 0:
        return None
    step = max(1.0, room / bins)
    nb = int(room // step) + 1
    best = np.zeros(nb)  # least noise with at most b steps used, over the items so far
    picks = np.zeros((len(items), nb), dtype=np.int16)
    for i, it in enumerate(items):
        new = np.full(nb, np.inf)
        for k, f in enumerate(opts[it]):
            w = int(np.ceil((size(it, f) - base[it]) / step))
            if w >= nb:
                continue
            cand = np.full(nb, np.inf)
            cand[w:] = best[:nb - w] + cost(it, f)
            better = cand < new
            new[better] = cand[better]
            picks[i, better] = k
        best = new
    b = int(np.argmin(best))  # the least noise (any bytes within the room)
    assign = {}
    for i in range(len(items) - 1, -1, -1):
        it = items[i]
        f = opts[it][int(picks[i, b])]
        assign.update({u: f for u in it})
        b -= int(np.ceil((size(it, f) - base[it]) / step))
    return model.predict({u: assign[u] for u in model.options})


def _exchange(model: Model, pred: Prediction, max_size: int) -> Prediction:
    """Improve a size plan by single and paired moves: any unit to any other option, or two
    units at once (one up, one down, or both any way), whichever lowers the objective most
    within ``max_size``, until no move does. The greedy search stops where its last step no
    longer fits, which can leave a noisier unit beside bytes a swap would use (a unit a step
    down pays for another a step up); the objective adds per unit, so each move is judged
    exactly. Each round looks at every pair of moves of two different units at once."""
    import numpy as np

    assign = dict(pred.assignment)
    for _ in range(4 * len(assign) + 1):  # each round lowers the objective; a bound all the same
        moves = [(u, f) for u, cur in assign.items() for f in model.options[u] if f != cur]
        if not moves:
            break
        room = max_size - model.predict(assign).bytes
        index = {u: i for i, u in enumerate(assign)}
        who = np.array([index[u] for u, _ in moves])
        d = np.array([model.size(u, f) - model.size(u, assign[u]) for u, f in moves],
                     dtype=np.int64)
        g = np.array([model.cost(u, f) - model.cost(u, assign[u]) for u, f in moves])
        single = np.where(d <= room, g, np.inf)
        pair = g[:, None] + g[None, :]
        pair[(d[:, None] + d[None, :]) > room] = np.inf
        pair[who[:, None] == who[None, :]] = np.inf
        i = int(single.argmin())
        j, k = divmod(int(pair.argmin()), len(moves))
        tol = 1e-12 * max(1.0, objective(model, model.predict(assign)))
        if min(single[i], pair[j, k]) >= -tol:
            break
        chosen = [moves[i]] if single[i] <= pair[j, k] else [moves[j], moves[k]]
        for u, f in chosen:
            assign[u] = f
    return model.predict(assign)


def reasons(model: Model, pred: Prediction, *, max_size: int | None = None,
            target_sqnr: float | None = None) -> dict[str, dict]:
    """unit -> why it got its format: ``why`` (one line) and ``options`` (each option's bytes,
    the whole-model SQNR with this unit alone in it (``alone_sqnr_db``, None for float), and
    the planned file's predicted worse-output SQNR and size with this unit in that option).
    ``max_size`` / ``target_sqnr``: the plan's budget or target, to say which options break it.
    A unit tied to its smoothing partner (``fold_ties``) is shown moved together with it, as
    the plan would move them."""
    from h3quant.sizes import size_text

    table = model.sens.table()
    tied = fold_ties(model)
    partner = {**dict(tied), **{b: a for a, b in tied}}
    out: dict[str, dict] = {}
    for unit, fmt in pred.assignment.items():
        options: dict[str, dict] = {}
        alts: list[str] = []
        mate = partner.get(unit)
        for opt in model.options[unit]:
            move = {unit: opt, **({mate: opt} if mate and opt in model.options[mate] else {})}
            trial = pred if opt == fmt else model.predict({**pred.assignment, **move})
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
            alts.append(f"as {opt}" + (f" (with {mate}, its smoothing partner)"
                                       if len(move) > 1 else "")
                        + f": file {trial.min_sqnr_db:.2f} dB, "
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


def smoothing_room(sens: Sensitivity, assignment: dict[str, str]) -> int:
    """The most bytes convert's header list of smoothed layers can add for ``assignment``
    (every linear of a smoothed candidate listed; the header-only size plan leaves the list
    out, because which layers smoothing takes is decided while converting)."""
    import json

    from h3quant.h3.provenance import SMOOTHING_KEY
    from h3quant.h3.topology import BLOCK_LINEARS

    names = []
    for unit, fmt in assignment.items():
        if is_smoothed(fmt):
            subs = [f".{s}" for s in BLOCK_LINEARS] if unit.count(".") == 1 else [""]
            names += [sens.prefix + unit + s for s in subs]
    if not names:
        return 0
    value = json.dumps(sorted(names), separators=(",", ":"))
    return len(json.dumps({SMOOTHING_KEY: value})) + 8  # the entry, its comma, the padding


def calibrated_formats(assignment: dict[str, str]) -> list[str]:
    """The calibrated candidates (``+gptq``) an assignment uses: its recipe reproduces them
    only when converted with the same statistics (``convert --recipe R --calibration S``)."""
    return sorted({f for f in assignment.values() if split_calibrated(f)[1]})
