"""Convert a plan's layers, while ``convert.stream`` copies the byte-for-byte tensors.

``convert_layers`` runs inside a ``stream.CopyStream`` (output writers open, copies running):
each layer's codes, scales and marker are written at their planned offsets as soon as they are
computed, so memory holds one layer (in row chunks for int8 and bf16). A layer whose conversion
fails is recorded and the run goes on, so every failure is listed; the output is then discarded.
This module imports torch; ``stream.run_plan`` imports it only once the copies have started.
"""

from __future__ import annotations

import functools
import os
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from h3quant.alloc import keep_freed_memory
from h3quant.errors import ContainerError, FindingError, FormatError, H3QuantError
from h3quant.findings import Severity, rule
from h3quant.formats import check as rules
from h3quant.formats import registry
from h3quant.pipelines.convert.compute import SourceRows, encode_layer
from h3quant.pipelines.convert.folds import ChannelScales
from h3quant.pipelines.convert.io import by_input_offset
from h3quant.pipelines.convert.plan import ConvertPlan
from h3quant.pipelines.convert.relayout import run_via
from h3quant.pipelines.convert.report import layer_metrics
from h3quant.pipelines.convert.result import (  # noqa: F401 (re-exported)
    ConvertReport,
    LayerFailures,
    build_report,
)


def check_source_scales(lp, reader) -> None:
    """Refuse a source layer whose scales break ``validate --deep``'s rules (NaN, infinite,
    zero or negative): re-encoding them would write a clean-looking file with garbage weights."""
    codec = registry.codec_for(lp.src_fields, tensor=lp.name)
    for suffix in codec.spec.verify.deep_scales:
        info = lp.inputs.get(suffix)
        if info is None or not info.shape and info.nbytes == 0:
            continue
        values = reader.whole(info)
        if info.dtype == "U8":  # W4A8 s_rel may be stored as raw e4m3 bits
            values = values.view(torch.float8_e4m3fn)
        for v in rules.scale_violations(values):
            raise FormatError(f"[{v.code}] source {suffix}: {v.message}; nothing written",
                              tensor=info.name, code=v.code)

    def read(info, dtype=None):
        t = reader.whole(info).contiguous().reshape(-1)
        return t.view(dtype) if dtype is not None else t

    for v in codec.checks.layer_data_violations(lp.inputs, read, lp.src_fields or {}):
        if rule(v.code).severity is Severity.ERROR:  # nvfp4 block scales against codes ...
            info = lp.inputs.get(v.suffix)
            raise FormatError(f"[{v.code}] source {v.suffix}: {v.message}; nothing written",
                              tensor=info.name if info is not None else lp.name, code=v.code)


def check_source_codebook(lp, reader) -> None:
    """Refuse a source layer whose whole-read tables (a W4A8 codebook) break ``validate
    --deep``'s rule (D104), whatever becomes of the layer: decoded through it, its codes would
    be laundered into a clean-looking file; copied, the output would carry the same broken table."""
    codec = registry.get(lp.src_fields["format"]) if lp.src_fields else None
    if codec is None:
        return
    for suffix in codec.spec.verify.deep_whole:
        info = lp.inputs.get(suffix)
        if info is None:
            continue
        v = codec.checks.data_violation(suffix, reader.whole(info))
        if v is not None:
            raise FindingError(f"[{v.code}] source {suffix}: {v.message}; nothing written",
                               tensor=info.name, code=v.code)


class CheckedRows(SourceRows):
    """Source rows checked with the finite-weights rule (D106) as they are read."""

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        out = super().rows(r0, r1)
        v = rules.weight_violation(out, r0 * (out[0].numel() if out.dim() and len(out) else 0))
        if v is not None:
            raise FormatError(f"[{v.code}] source weight: {v.message}; nothing written",
                              tensor=f"{self.lp.name}.weight", code=v.code)
        return out


def check_kept_layer(lp, reader) -> None:
    """Refuse a quantized layer convert copies as it is (kept, skipped, untouched) when its
    source breaks the rules a converted layer's source is held to: its scales (D101 / D102 ...)
    and its weight decoded through the codec, every value finite (D106). Copying it would
    write a file that ``validate --deep`` fails, as converting it would be refused."""
    from h3quant.pipelines.convert.compute import rows_per_chunk

    fmt = (lp.src_fields or {}).get("format")
    codec = registry.get(fmt) if fmt is not None else None
    if codec is None or "weight" not in lp.inputs:
        return
    try:
        check_source_scales(lp, reader)
        rows = CheckedRows(lp, reader)
        n, k = lp.n, lp.k
    except (KeyError, NotImplementedError):
        return  # a layer whose tensors the header rules already refuse
    step = rows_per_chunk(k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows.rows(r0, r1)
        rows.release(r0, r1)


def convert_layers(plan: ConvertPlan, stream, bar) -> dict[str, dict]:
    """Convert ``plan``'s layers into ``stream`` (a ``stream.CopyStream``), in input offset
    order, their row chunks on ``workers`` threads; returns each layer's report entry. Waits
    for the copies; raises ``LayerFailures`` when any layer failed (after trying them all)."""
    opts = plan.options
    keep_freed_memory()  # chunk temporaries reused, not page-faulted in again (see h3quant.alloc)
    results: dict[str, dict] = {}
    failures: list[dict] = []
    layers = by_input_offset(plan.layers, lambda lp: lp.weight)
    workers = opts.workers
    assert workers is not None  # ConvertOptions sets it
    pool = ThreadPoolExecutor(workers) if workers > 1 else None
    threads = torch.get_num_threads()
    if workers > 1:  # the workers share the cores: no nested intra-op teams
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    ok = False
    try:
        scales = (ChannelScales(plan, lambda lp: CheckedRows(lp, stream.reader))
                  if plan.folds and plan.calibration is not None else None)
        run = functools.partial(_run_layer, plan=plan, reader=stream.reader, sinks=stream.sinks,
                                bar=bar, results=results, failures=failures, scales=scales)
        _convert_layers(layers, run, pool, stream)
        stream.sinks.wait_behind()  # the last layer's outputs (a write error is raised here)
        stream.copying.result()
        for entry in results.values():  # collect the report tasks before the files close
            if isinstance(entry.get("metrics"), Future):
                entry["metrics"] = entry["metrics"].result()
        if failures:
            raise LayerFailures(f"{len(failures)} layer(s) failed to convert; nothing written: "
                                + "; ".join(f"{f['name']}: {f['error']}" for f in failures))
        ok = True
    finally:
        if pool is not None:  # after an error, chunks still running finish on their own
            pool.shutdown(wait=ok, cancel_futures=True)
        torch.set_num_threads(threads)
    return results


def _convert_layers(layers, run, pool, stream) -> None:
    """Layers one after another, their row chunks on the pool (a W4A8 layer chooses its
    codebook from the whole layer first, then encodes its row chunks on the pool too): one
    layer in memory at a time, every worker busy until the layer's last chunk."""
    for lp in layers:
        if stream.failed():
            return
        run(lp, pool=pool)


def run_layer(lp, **kw) -> None:
    """One planned layer through the layer pass (``convert.onepass`` runs a block with it)."""
    _run_layer(lp, **kw)


def _run_layer(lp, *, plan, reader, sinks, bar, pool, results, failures, scales=None) -> None:
    opts = lp.options or plan.options  # a per-layer rule's target, else --to
    if plan.precomputed is not None and lp.name in plan.precomputed:  # one pass: done before
        results[lp.name] = {**lp.to_dict(), **plan.precomputed.write(lp, sinks)}
        bar.update(sum(t.nbytes for t in lp.inputs.values()
                       if t.name not in {c.src.name for c in lp.copies}))
        return
    copied = {c.src.name for c in lp.copies}
    total = sum(t.nbytes for t in lp.inputs.values() if t.name not in copied)
    done = [0]

    def progress(n):
        n = min(n, total - done[0])
        done[0] += n
        bar.update(n)

    entry = lp.to_dict()
    try:
        check_source_codebook(lp, reader)
        if lp.action == "convert":
            check_source_scales(lp, reader)  # validate --deep's rules, before any output
        if lp.action == "convert" and lp.via != "encode":  # codes moved, not quantized
            run_via(lp, reader, sinks, progress, opts.codec)
        elif lp.action == "convert":
            src: Any = CheckedRows(lp, reader)  # or folds.Rescaled around it
            st, info = (None, None)
            s, scaled, fold = None, None, None
            if scales is not None:  # AWQ channel scaling: this layer's side of a fold
                src, found, fold = scales.source(lp, src)
                if found is not None:
                    s, scaled = found
            if plan.calibration is not None and opts.codec.spec.quantized:
                st, info = plan.calibration.for_layer(lp.name, lp.k, opts.codec, lp.out_fields)
                entry["calibration"] = info
            if fold is not None:
                key = "channel_scaling" if lp.name in plan.folds else "folded_scale"
                entry.setdefault("calibration", {})[key] = fold
            stats = st if s is None or st is None else (scaled or st.scaled(s))
            samples = encode_layer(lp, src, opts, sinks, progress, opts.workers, pool,
                                   calibration=stats)
            if stats is not None and stats is not st:
                stats.release()
            if opts.report:  # on a worker when there are any: overlaps the next layer
                ref, out = samples.cat()
                args = (opts.codec, lp, ref, out)
                if info is not None:
                    w_hat, _ = opts.codec.encoder.report_grid(out, lp.out_fields or {})
                    if s is not None:  # the error of W diag(s) on x / s: in the plain basis
                        ref, w_hat = ref / s, w_hat / s
                    info["output_sqnr_db"] = plan.calibration.output_sqnr(lp, ref, w_hat)
                entry["metrics"] = (pool.submit(layer_metrics, *args) if pool
                                    else layer_metrics(*args))
            if st is not None:
                st.release()
            elif plan.calibration is not None:
                lay = plan.calibration.stats.layer(lp.name)
                if lay is not None:
                    lay.release()
        else:
            check_kept_layer(lp, reader)  # copied as it is: the same verdict as converted
            for name in lp.produced:  # keep / skip / untouched produce at most a marker
                sinks.write(name, 0, lp.marker)
    except H3QuantError as exc:
        if isinstance(exc, ContainerError) and exc.code == "C112":
            raise  # the input could not be read at all (a mapping refused, I/O): about the
            # file, not the layer, so the first one ends the run with the file named
        why = (f"[{exc.code}] {exc.reason}" if exc.code and f"[{exc.code}]" not in exc.reason
               else exc.reason)  # the rule's code, as validate names it
        entry["error"] = why
        failures.append({"name": lp.name, "error": why})
    progress(total)
    results[lp.name] = entry

