"""AWQ channel scaling folded into the layer before (``convert --calibration``).

A layer whose target codec ``scales_channels`` (awq_w4a16) is stored as ``W diag(s)``, and its
input must then be ``x / s``. That division is folded, in float, into the output rows of the
linear that produces the input (``h3.topology.FOLDABLE_INPUTS``: the v rows of qkv_proj before
out_proj, the up rows of fc1 before fc2), before that predecessor is encoded in whatever format
the run gives it. A pair is folded only when both layers are re-encoded from float in this run
(``plan_folds``, from the plan alone: the header names the pairs, ``HEADER_KEY``); a predecessor
kept, copied or moved without requantizing, or one with a bias, leaves its consumer unscaled.
``--no-awq-scale`` turns it off.

At run time (``ChannelScales``) the scale of a pair is searched when the first of its two layers
comes (the search reads only the consumer's float weight and statistics; the codec's
``channel_scale``) and kept, with the statistics of the scaled inputs (their error-feedback
factor computed once), until both are written: memory holds about one layer more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from h3quant.h3.provenance import SCALING_KEY as HEADER_KEY
from h3quant.h3.provenance import read_scaling
from h3quant.h3.topology import fold_predecessor, folded_rows


@dataclass(frozen=True)
class Fold:
    consumer: str  # the layer stored as W diag(s)
    predecessor: str  # the layer whose output rows [r0, r1) are divided by s
    rows: tuple[int, int]


def plan_folds(layers, options) -> dict[str, Fold]:
    """The folds of a plan's layers, by consumer name (empty without statistics or with
    ``--no-awq-scale``)."""
    if not (options.calibration or options.calibrate_on) or not options.awq_scale:
        return {}
    by_name = {lp.name: lp for lp in layers}

    def encoded(lp) -> bool:
        return lp is not None and lp.action == "convert" and lp.via == "encode"

    folds: dict[str, Fold] = {}
    for lp in layers:
        pred_name = fold_predecessor(lp.name)
        if pred_name is None or not encoded(lp):
            continue
        if not (lp.options or options).codec.spec.encoding.scales_channels:
            continue
        pred = by_name.get(pred_name)
        if pred is None or not encoded(pred) or "bias" in pred.inputs \
                or any(c.src.name == f"{pred_name}.bias" for c in pred.copies):
            continue
        rows = folded_rows(lp.name, pred.n, lp.k)
        if rows is not None:
            folds[lp.name] = Fold(lp.name, pred_name, rows)
    return folds


def header_value(folds: dict[str, Fold], before: str | None = None) -> str:
    """The header value: ``{consumer: predecessor}`` (with the source file's own entries)."""
    table = read_scaling({HEADER_KEY: before} if before else None)
    table.update({f.consumer: f.predecessor for f in folds.values()})
    return json.dumps(table, sort_keys=True, separators=(",", ":"))


class Rescaled:
    """Source rows with the fold applied in fp32: columns times ``cols`` (the consumer), or rows
    ``[r0, r1)`` divided by ``s`` (the predecessor). Everything else is the inner source's."""

    def __init__(self, inner, *, cols=None, rows=None):
        self.inner, self.cols, self.fold_rows = inner, cols, rows

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def rows(self, r0: int, r1: int):
        import torch

        out = self.inner.rows(r0, r1)
        if self.cols is not None:
            out = out.to(torch.float32) * self.cols
        if self.fold_rows is not None:
            a, b, s = self.fold_rows
            lo, hi = max(a, r0), min(b, r1)
            if lo < hi:
                out = out.to(torch.float32, copy=True)
                out[lo - r0:hi - r0] /= s[lo - a:hi - a, None]
        return out


class ChannelScales:
    """The run's folds: each pair's scale searched once, dropped when both layers are written."""

    def __init__(self, plan, make_rows):
        self.plan, self.make_rows = plan, make_rows
        self.folds: dict[str, Fold] = plan.folds
        self.of_pred = {f.predecessor: f for f in self.folds.values()}
        self.by_name = {lp.name: lp for lp in plan.layers}
        self._found: dict[str, tuple] = {}  # consumer -> (s or None, info)
        self._done: dict[str, int] = {}

    def _search(self, fold: Fold) -> tuple:
        if fold.consumer not in self._found:
            lp = self.by_name[fold.consumer]
            codec = (lp.options or self.plan.options).codec
            st = self.plan.calibration.stats.layer(lp.name)
            if st is None or st.k != lp.k:  # refused or noted when the layer itself runs
                self._found[fold.consumer] = (None, None, {})
            else:
                src = self.make_rows(lp)
                w = src.rows(0, lp.n).float()
                src.release(0, lp.n)
                s, scaled, info = codec.encoder.channel_scale(w, lp.out_fields, st)
                del w
                info = {"predecessor": fold.predecessor, **info}
                self._found[fold.consumer] = (s, scaled, info)
                sq = info.get("output_sqnr_db", {})
                if sq:
                    self.plan.calibration.log(
                        f"AWQ channel scaling of {lp.name}: alpha {info.get('alpha', 0.0):g}, "
                        f"output SQNR {sq.get('unscaled')} -> {sq.get('scaled')} dB on "
                        f"{info.get('rows_searched')} rows"
                        + (f", folded into {fold.predecessor}" if s is not None else
                           " (no scaling)"))
        return self._found[fold.consumer]

    def _used(self, fold: Fold) -> None:
        self._done[fold.consumer] = self._done.get(fold.consumer, 0) + 1
        if self._done[fold.consumer] == 2:
            self._found.pop(fold.consumer, None)

    def source(self, lp, src):
        """(the rows to encode ``lp`` from, the consumer's (scale, statistics of ``x / s``) or
        None, the report entry)."""
        if lp.name in self.folds:
            fold = self.folds[lp.name]
            s, scaled, info = self._search(fold)
            self._used(fold)
            if s is None:
                return src, None, info
            return Rescaled(src, cols=s), (s, scaled), info
        fold = self.of_pred.get(lp.name)
        if fold is not None:
            s, _, _ = self._search(fold)
            self._used(fold)
            entry = {"consumer": fold.consumer, "rows": list(fold.rows),
                     "scaled": s is not None}
            if s is None:
                return src, None, entry
            return Rescaled(src, rows=(*fold.rows, s)), None, entry
        return src, None, None


__all__ = ["HEADER_KEY", "ChannelScales", "Fold", "Rescaled", "header_value", "plan_folds"]
