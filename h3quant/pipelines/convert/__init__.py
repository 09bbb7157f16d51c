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

from h3quant.formats.container.atomic import Outputs, resolve_stale, write_bytes, write_file
from h3quant.sources import SourceView, adopt_mapping, input_paths, open_source
from h3quant.pipelines.convert.options import TARGETS, ConvertOptions
from h3quant.pipelines.convert import survival
from h3quant.pipelines.convert.plan import ConvertPlan, build_plan
from h3quant.pipelines.convert.result import ConvertReport, LayerFailures
from h3quant.pipelines.convert.stream import run_plan
from h3quant.pipelines.convert.view import source_view

__all__ = ["TARGETS", "ConvertOptions", "ConvertPlan", "ConvertReport", "LayerFailures", "convert",
           "native_target", "plan_convert", "write_report"]


def plan_convert(src: str | os.PathLike, dst: str | os.PathLike,
                 options: ConvertOptions | None = None, *, dry_run: bool = True) -> ConvertPlan:
    """The conversion plan (what each layer becomes, the output files and sizes). With
    ``dry_run`` an existing output is a warning in the plan rather than a refusal."""
    options = options or ConvertOptions()
    src, dst = Path(src), Path(dst)
    register_files(None, src, dst, options.loras).check(overwrite=True)
    with open_source(src, mmap=options.mmap) as ckpt:
        det, mapping = adopt_mapping(ckpt, options.naming)
        if mapping.trivial and not options.loras and options.smooth == "off":
            return build_plan(ckpt, src, dst, options, dry_run=dry_run)
        source, loras = source_view(ckpt, mapping, options)
        options = _promoted(options, loras)
        plan = build_plan(source, src, dst, options, dry_run=dry_run)
        plan.warnings += getattr(source, "notes", [])
    if not mapping.trivial:
        plan.naming = _naming(det, mapping)
    if loras is not None:
        plan.lora = survival.summary(loras)
    return plan


def convert(src: str | os.PathLike, dst: str | os.PathLike, options: ConvertOptions | None = None,
            *, progress: bool = False, log=None,
            report_path: str | os.PathLike | None = None, files=None,
            precomputed=None) -> ConvertReport:
    """Convert ``src`` to ``dst``; returns the ``ConvertReport``, also written (as JSON) to ``report_path`` when
    given. Both outputs are checked before any work and appear together or not at all
    (``formats.container.atomic.Outputs``). Raises ``OutputError`` (refused output path), ``ConvertError``
    (refused), ``LayerFailures`` (exit 1, nothing written) or a reader error for a broken input.

    An official, diffusers or fp8 input is converted through ``sources.SourceView``: the output is
    ComfyUI's single file, byte for byte what converting the equivalent ComfyUI file gives.

    ``files``: the command's ``CommandFiles`` (a recipe it read, ...); IN, its shards, every
    ``--lora`` file, OUT and the report are registered here in any case, and no output may name
    any of them (``OutputError``, before any work)."""
    import time

    t0 = time.perf_counter()
    options = options or ConvertOptions()
    log = log or (lambda msg: None)
    src, dst = Path(src), Path(dst)
    files = register_files(files, src, dst, options.loras, report_path)
    files.check(overwrite=options.overwrite)
    if options.calibrate_on and precomputed is None:  # one pass, block by block (onepass)
        from h3quant.pipelines.convert.onepass import onepass_convert

        return onepass_convert(src, dst, options, progress=progress, log=log,
                               report_path=report_path, files=files, convert_fn=convert)
    resolve_stale([dst, report_path], log)  # undo a killed run's half-finished move first
    with open_source(src, mmap=options.mmap) as ckpt:
        det, mapping = adopt_mapping(ckpt, options.naming)
        source, loras = ckpt, None
        smoothed, smooth_report = None, None
        if not mapping.trivial or options.loras or options.smooth != "off":
            source, loras = source_view(ckpt, mapping, options)
            options = _promoted(options, loras)
        if options.smooth != "off":  # after any LoRA is baked: the factors fit the merged weights
            from h3quant.pipelines.convert import smoothing

            if precomputed is not None:  # the one pass chose them block by block
                smoothed, smooth_report = precomputed.smoothed, precomputed.smoothing
                smoothing.fold_found(source, smoothed, smooth_report, log)
            else:
                smoothed, smooth_report = smoothing.apply(source, options, src, log)
        if not mapping.trivial:
            log(f"input naming: {det.naming} ({det.evidence}); written as ComfyUI's single file")
            for name in mapping.unused:
                log(f"not used by ComfyUI, not written: {name}")
        if loras is not None:
            for line in loras.skipped:
                log(f"LoRA key skipped (--lora-skip-unmatched): {line}")
        plan = build_plan(source, src, dst, options)
        plan.precomputed = precomputed
        plan.warnings += getattr(source, "notes", [])
        for path in input_paths(source, src):
            files.read(path, "input shard")
        for stats in (options.calibration, options.calibration_heldout):
            if stats:
                files.read(Path(stats), "calibration statistics")
        with Outputs(files=files, overwrite=options.overwrite, log=log) as outs:
            out = outs.add(dst, directory=plan.directory)
            report_out = outs.add(report_path, what="report") if report_path else None
            for line in plan.repairs:
                log(f"repair: {line}")
            for line in plan.warnings:
                log(f"note: {line}")
            if plan.identity and source is not ckpt:
                log("no layer re-encoded: the input's tensors are written in ComfyUI's layout")
            elif plan.identity:
                log("nothing to convert: every selected layer is already in the target format; "
                    "the output re-emits the input")
            if options.calibration:
                from h3quant.pipelines.convert.calibrated import Calibration

                plan.calibration = Calibration(options.calibration, src, log,
                                               heldout=options.calibration_heldout,
                                               smoothed=smoothed,
                                               aware=options.activation_aware == "auto")
            try:
                report = run_plan(plan, source, out, progress=progress)
            finally:
                if plan.calibration is not None:
                    plan.calibration.close()
            if not mapping.trivial:
                report.extra["naming"] = _naming(det, mapping)
            if smooth_report is not None:
                report.extra["smoothing"] = smooth_report
            if loras is not None:
                report.extra["lora"] = survival.measure(source, loras, plan, options, log,
                                                        progress=progress)
            # the reported time covers the whole run (the LoRA survival pass included)
            report.elapsed_s = round(time.perf_counter() - t0, 3)
            report.input_mb_per_s = (round(plan.input_bytes / 1e6 / report.elapsed_s, 1)
                                     if report.elapsed_s > 0 else None)
            ckpt.check_unchanged()  # an input rewritten while read gives no output
            if report_out is not None:
                write_file(report_out, report_bytes(report.to_dict()))
        return report


def register_files(files, src, dst, loras=(), report_path=None):
    """``files`` (a new ``CommandFiles`` when None) with every file of this conversion: IN,
    each ``--lora`` file, OUT and the report."""
    from h3quant.formats.container.iofiles import CommandFiles
    from h3quant.pipelines.convert.options import parse_lora_spec

    files = files if files is not None else CommandFiles("convert")
    files.checkpoint(src, "input")
    for spec in loras:
        files.read(parse_lora_spec(spec)[0], "LoRA")
    if all(o.path != Path(dst) for o in files.outputs):
        files.write(dst, "output", directory=Path(src).is_dir() or Path(dst).is_dir())
    if report_path is not None and all(o.path != Path(report_path) for o in files.outputs):
        files.write(report_path, "report")
    return files


def native_target(src: str | os.PathLike, naming: str = "auto", *, mmap: bool = True
                  ) -> tuple[str, int, str] | None:
    """(``--to``, group size, layout) that writes ``src``'s quantized layers in their own format
    (None: it has none); ``ConvertError`` when its layers use several formats."""
    from h3quant.pipelines.convert import bake

    with open_source(Path(src), mmap=mmap) as ckpt:
        _, mapping = adopt_mapping(ckpt, naming)
        return bake.native_target(SourceView(ckpt, mapping, True))


def _promoted(options: ConvertOptions, loras) -> ConvertOptions:
    """``--lora-promote FMT``: a first rule writing every layer the LoRAs touch as FMT."""
    if loras is None or options.lora_promote is None or not loras.layers:
        return options
    import re
    from dataclasses import replace

    from h3quant.pipelines.convert.recipe import Rule

    pattern = "^(?:" + "|".join(re.escape(n) for n in sorted(loras.layers)) + ")$"
    return replace(options, layers=(Rule(pattern, options.lora_promote, internal=True),)
                   + options.layers)


def _naming(det, mapping) -> dict:
    return {"detected": det.naming, "evidence": det.evidence, **mapping.to_dict()}


def report_bytes(report: dict) -> bytes:
    return (json.dumps(report, indent=2, default=str) + "\n").encode("utf-8")


def write_report(path: str | os.PathLike, report: dict, *, overwrite: bool = True) -> None:
    """Write ``report`` as JSON, atomically (``formats.container.atomic``)."""
    write_bytes(path, report_bytes(report), overwrite=overwrite, what="report")
