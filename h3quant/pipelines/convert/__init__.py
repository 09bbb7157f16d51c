"""``convert``: re-encode a checkpoint's linears to int8 (ConvRot), W4A8 or back to BF16.

Public API::

    plan = plan_convert(src, dst, ConvertOptions(target="int8-convrot"))   # header only
    report = convert(src, dst, ConvertOptions(...), progress=True, log=print)
    write_report(path, report)          # atomic JSON

The plan is computed from the input header alone; the run streams every tensor to its planned
offset (see ``convert.stream``), writes atomically (temp file / staging directory renamed into
place) and leaves nothing at the output on any error or interrupt. Importing this package does
not import torch: a run opens its output and starts the byte-for-byte copies first, then loads
torch (``convert.run``) for the layers while the copies go on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from h3quant.formats.container.atomic import Outputs, write_bytes, write_file
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.pipelines.convert.options import TARGETS, ConvertOptions
from h3quant.pipelines.convert.plan import ConvertPlan, build_plan, input_paths
from h3quant.pipelines.convert.result import ConvertReport, LayerFailures
from h3quant.pipelines.convert.stream import run_plan

__all__ = ["TARGETS", "ConvertOptions", "ConvertPlan", "ConvertReport", "LayerFailures", "convert",
           "plan_convert", "write_report"]


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
            report_path: str | os.PathLike | None = None) -> ConvertReport:
    """Convert ``src`` to ``dst``; returns the ``ConvertReport``, also written (as JSON) to ``report_path`` when
    given. Both outputs are checked before any work and appear together or not at all
    (``formats.container.atomic.Outputs``). Raises ``OutputError`` (refused output path), ``ConvertError``
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
            for line in plan.warnings:
                log(f"note: {line}")
            if plan.identity:
                log("nothing to convert: every selected layer is already in the target format; "
                    "the output re-emits the input")
            report = run_plan(plan, ckpt, out, progress=progress)
            ckpt.check_unchanged()  # an input rewritten while read gives no output
            if report_out is not None:
                write_file(report_out, report_bytes(report.to_dict()))
        return report


def report_bytes(report: dict) -> bytes:
    return (json.dumps(report, indent=2, default=str) + "\n").encode("utf-8")


def write_report(path: str | os.PathLike, report: dict, *, overwrite: bool = True) -> None:
    """Write ``report`` as JSON, atomically (``formats.container.atomic``)."""
    write_bytes(path, report_bytes(report), overwrite=overwrite, what="report")
