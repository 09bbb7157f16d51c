"""``convert``: re-encode a checkpoint's linears to int8 (ConvRot), W4A8 or back to BF16.

Public API::

    plan = plan_convert(src, dst, ConvertOptions(target="int8-convrot"))   # header only
    report = convert(src, dst, ConvertOptions(...), progress=True, log=print)
    write_report(path, report)          # atomic JSON
    render_plan(plan.to_dict())         # human text (also for a finished report)

The plan is computed from the input header alone; the run streams every tensor to its planned
offset (see ``convert_run``), writes atomically (temp file / staging directory renamed into
place) and leaves nothing at the output on any error or interrupt.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from h3quant.formats.atomic import Outputs, write_bytes, write_file
from h3quant.formats.checkpoint import Checkpoint
from h3quant.pipelines.convert.options import TARGETS, ConvertOptions
from h3quant.pipelines.convert.plan import ConvertPlan, build_plan, input_paths
from h3quant.pipelines.convert.report import summary_line
from h3quant.pipelines.convert.run import LayerFailures, run_plan

__all__ = ["TARGETS", "ConvertOptions", "ConvertPlan", "LayerFailures", "convert",
           "plan_convert", "render_plan", "summary_line", "write_report"]


def plan_convert(src: str | os.PathLike, dst: str | os.PathLike,
                 options: ConvertOptions | None = None, *, dry_run: bool = True) -> ConvertPlan:
    """The conversion plan (what each layer becomes, the output files and sizes). With
    ``dry_run`` an existing output is a warning in the plan rather than a refusal."""
    options = options or ConvertOptions()
    src, dst = Path(src), Path(dst)
    with Checkpoint(src, mmap=options.mmap) as ckpt:
        return build_plan(ckpt, src, dst, options, dry_run=dry_run)


def convert(src: str | os.PathLike, dst: str | os.PathLike, options: ConvertOptions | None = None,
            *, progress: bool = False, log=None,
            report_path: str | os.PathLike | None = None) -> dict:
    """Convert ``src`` to ``dst``; returns the report dict, also written to ``report_path`` when
    given. Both outputs are checked before any work and appear together or not at all
    (``formats.atomic.Outputs``). Raises ``OutputError`` (refused output path), ``ConvertError``
    (refused), ``LayerFailures`` (exit 1, nothing written) or a reader error for a broken input."""
    options = options or ConvertOptions()
    log = log or (lambda msg: None)
    src, dst = Path(src), Path(dst)
    with Checkpoint(src, mmap=options.mmap) as ckpt:
        plan = build_plan(ckpt, src, dst, options)
        with Outputs(inputs=input_paths(ckpt, src), overwrite=options.overwrite,
                     log=log) as outs:
            out = outs.add(dst, directory=plan.directory)
            report_out = outs.add(report_path, what="report") if report_path else None
            for line in plan.repairs:
                log(f"repair: {line}")
            if plan.identity:
                log("nothing to convert: every selected layer is already in the target format; "
                    "the output re-emits the input")
            report = run_plan(plan, ckpt, out, progress=progress)
            ckpt.check_unchanged()  # an input rewritten while read gives no output
            if report_out is not None:
                write_file(report_out, report_bytes(report))
        return report


def report_bytes(report: dict) -> bytes:
    return (json.dumps(report, indent=2, default=str) + "\n").encode("utf-8")


def write_report(path: str | os.PathLike, report: dict, *, overwrite: bool = True) -> None:
    """Write ``report`` as JSON, atomically (``formats.atomic``)."""
    write_bytes(path, report_bytes(report), overwrite=overwrite, what="report")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def render_plan(d: dict) -> str:
    """Human-readable plan (or report): layers by action, copies, repairs, output size."""
    lines = [f"convert {d['input']} -> {d['output']}",
             f"target {d['target']} (group size {d['group_size']})"
             + (f", layout {d['layout']}" if d.get("layout", "canonical") != "canonical" else "")
             + f", preset {d['preset']}"
             + (" (H3 detected)" if d["h3"] else "")]
    by = {}
    for lay in d["layers"]:
        by.setdefault(lay["action"], []).append(lay)
    titles = {"convert": "convert", "keep": "already in the target format (re-emitted)",
              "skip": "skipped", "untouched": "quantized, not selected (copied)"}
    for action, title in titles.items():
        rows = by.get(action, [])
        if not rows:
            continue
        lines.append(f"{title}: {len(rows)} layer(s)")
        for lay in rows:
            extra = f"  [{lay['reason']}]" if lay.get("reason") else ""
            err = f"  FAILED: {lay['error']}" if lay.get("error") else ""
            m = lay.get("metrics")
            met = (f"  rel {m['weight_rel_l2']:.4f} sqnr {m['sqnr_db']:.1f} dB "
                   f"out {m['output_rel_l2']:.4f}") if m else ""
            lines.append(f"  {lay['name']} {lay['shape']}: {lay['from']} -> {lay['to']}"
                         f"{extra}{met}{err}")
            for note in lay.get("notes", ()):
                lines.append(f"      note: {note}")
    c = d["copied"]
    lines.append(f"copied byte for byte: {c['tensors']} tensor(s), {_mb(c['bytes'])}")
    if d["dropped"]:
        lines.append(f"not written (replaced or dropped): {len(d['dropped'])} tensor(s)")
    for r in d["repairs"]:
        lines.append(f"repair: {r}")
    for w in d.get("warnings", ()):
        lines.append(f"warning: {w}")
    if d.get("identity"):
        lines.append("nothing to convert: the output re-emits the input unchanged")
    files = d["files"]
    where = f" in {len(files)} files" if len(files) > 1 else ""
    lines.append(f"output size: {d['output_bytes']:,} bytes ({_mb(d['output_bytes'])}){where}; "
                 f"input {_mb(d['input_bytes'])}")
    return "\n".join(lines)
