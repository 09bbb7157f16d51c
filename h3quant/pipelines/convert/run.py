"""Run a planned conversion: stream every tensor to its place in the output, atomically.

Each output tensor is written at the offset ``plan_layout`` gave it (``OffsetWriter``), so a
layer's codes, scales and marker are written as soon as they are computed and memory holds one
layer (in row chunks for int8 and bf16). A copy thread streams the byte-for-byte tensors while
the layers convert; both read the input in offset order. A layer whose conversion fails is
recorded and the run goes on, so every failure is listed; the output is then discarded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from h3quant.errors import ConvertError, FormatError, H3QuantError
from h3quant.formats import registry, rules
from h3quant.formats.atomic import fsync_dir
from h3quant.pipelines.convert.compute import SourceRows, copy_tensor, encode_layer
from h3quant.pipelines.convert.io import OffsetWriter, Reader
from h3quant.pipelines.convert.options import REPORT_ROWS, REPORT_TOKENS
from h3quant.pipelines.convert.plan import ConvertPlan
from h3quant.pipelines.convert.relayout import run_via
from h3quant.pipelines.convert.report import layer_metrics, summarize


class LayerFailures(ConvertError):
    """Some layers could not be converted; nothing was written."""

    exit_code = 1


class _Sinks:
    """Routes each output tensor name to the writer of its shard."""

    def __init__(self, plan: ConvertPlan, writers: dict[str, OffsetWriter]):
        self._by_name = {e.name: writers[s] for s, sp in plan.shards.items() for e in sp.entries}

    def write(self, name: str, start: int, data) -> None:
        self._by_name[name].write(name, start, data)

    def write_tensor(self, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        self._by_name[name].write_tensor(name, tensor, start)

    def copy_range(self, name: str, start: int, src_fd: int, src_pos: int, length: int) -> int:
        return self._by_name[name].copy_range(name, start, src_fd, src_pos, length)


def check_source_scales(lp, reader) -> None:
    """Refuse a source layer whose scales break ``validate --deep``'s rules (NaN, infinite,
    zero or negative): re-encoding them would write a clean-looking file with garbage weights."""
    codec = registry.codec_for(lp.src_fields, tensor=lp.name)
    for suffix in codec.deep_scales:
        info = lp.inputs.get(suffix)
        if info is None or not info.shape and info.nbytes == 0:
            continue
        values = reader.whole(info)
        if info.dtype == "U8":  # W4A8 s_rel may be stored as raw e4m3 bits
            values = values.view(torch.float8_e4m3fn)
        for v in rules.scale_violations(values):
            raise FormatError(f"[{v.code}] source {suffix}: {v.message}; nothing written",
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


def _by_input_offset(items, info_of) -> list:
    return sorted(items, key=lambda x: (str(info_of(x).file), info_of(x).begin))


def _copy_all(items, reader, sinks, progress, stop: threading.Event) -> None:
    for item in items:
        if stop.is_set():
            return
        copy_tensor(item, reader, sinks, progress)


def run_plan(plan: ConvertPlan, ckpt, out, *, progress: bool = True) -> ConvertReport:
    """Execute ``plan`` (from ``build_plan``), writing to ``out`` (the staged path
    ``formats.atomic.Outputs`` gave for ``plan.dst``: a file, or an empty directory for sharded
    output), and return the ``ConvertReport``.

    Two streams run at once: a copy thread writes every byte-for-byte tensor while the main
    thread converts the layers (their row chunks on ``workers`` threads). Both read the input in
    offset order and write at planned offsets, so neither waits for the other.
    """
    opts = plan.options
    reader = Reader(ckpt)
    results: dict[str, dict] = {}
    failures: list[dict] = []
    t0 = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=plan.input_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               file=sys.stderr, disable=not progress, desc="convert", leave=False)
    copies = _by_input_offset(plan.all_copies(), lambda c: c.src)
    layers = _by_input_offset(plan.layers, lambda lp: lp.weight)
    pool = ThreadPoolExecutor(opts.workers) if opts.workers > 1 else None
    io = ThreadPoolExecutor(1, thread_name_prefix="h3quant-copy")
    stop = threading.Event()
    threads = torch.get_num_threads()
    if opts.workers > 1:  # the workers share the cores: no nested intra-op teams
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.workers))
    ok = False
    try:
        with contextlib.ExitStack() as stack:
            writers = _open_writers(plan, stack, out)
            sinks = _Sinks(plan, writers)
            copying = io.submit(_copy_all, copies, reader, sinks, bar.update, stop)
            try:
                run = functools.partial(_run_layer, plan=plan, reader=reader, sinks=sinks,
                                        bar=bar, results=results, failures=failures)
                _convert_layers(layers, run, pool, opts, copying)
                copying.result()
            finally:
                stop.set()
                io.shutdown(wait=True)
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
        bar.close()
    elapsed = time.perf_counter() - t0
    return build_report(plan, results, elapsed)


def _convert_layers(layers, run, pool, opts, copying) -> None:
    """Layers one after another, their row chunks on the pool; W4A8 layers (one encoder call
    per layer: its codebook is fitted on the whole layer) run ``workers`` at a time instead."""
    if pool is None or opts.codec.chunked:
        for lp in layers:
            if copying.done() and copying.exception() is not None:
                return
            run(lp, pool=pool)
        return
    pending: deque = deque()
    try:
        for lp in layers:
            pending.append(pool.submit(run, lp, pool=None))
            if len(pending) >= opts.workers:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()


def _open_writers(plan: ConvertPlan, stack: contextlib.ExitStack, out) -> dict[str, OffsetWriter]:
    """One writer per shard, writing into ``out`` (staged by the caller). Sharded output: on
    success the shards are complete (writers exit first), then the index is written."""
    out = Path(out)
    if not plan.directory:
        (name, shard), = plan.shards.items()
        return {name: stack.enter_context(OffsetWriter(out, shard.layout))}
    tmp = out

    def index_on_success(exc_type, exc, tb):
        if exc_type is None:
            _write_index(plan, tmp)
        return False

    stack.push(index_on_success)
    return {name: stack.enter_context(OffsetWriter(tmp / name, s.layout))
            for name, s in plan.shards.items()}


def _write_index(plan: ConvertPlan, tmp) -> None:
    """The shard index, written last (after every shard file is complete)."""
    weight_map = {e.name: s for s, sp in plan.shards.items() for e in sp.entries}
    meta = dict(plan.index_metadata)
    meta["total_size"] = sum(sp.layout.data_bytes for sp in plan.shards.values())
    body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    with open(tmp / plan.index_name, "wb") as fh:
        fh.write((json.dumps(body, indent=2) + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)


def _run_layer(lp, *, plan, reader, sinks, bar, pool, results, failures) -> None:
    opts = plan.options
    copied = {c.src.name for c in lp.copies}
    total = sum(t.nbytes for t in lp.inputs.values() if t.name not in copied)
    done = [0]

    def progress(n):
        n = min(n, total - done[0])
        done[0] += n
        bar.update(n)

    entry = lp.to_dict()
    try:
        if lp.action == "convert":
            check_source_scales(lp, reader)  # validate --deep's rules, before any output
        if lp.action == "convert" and lp.via != "encode":  # codes moved, not quantized
            run_via(lp, reader, sinks, progress, opts.codec)
        elif lp.action == "convert":
            src = CheckedRows(lp, reader)
            samples = encode_layer(lp, src, opts, sinks, progress, opts.workers, pool)
            if opts.report:  # on a worker when there are any: overlaps the next layer
                ref, out = samples.cat()
                args = (opts.codec, lp, ref, out)
                entry["metrics"] = (pool.submit(layer_metrics, *args) if pool
                                    else layer_metrics(*args))
        else:
            for name in lp.produced:  # keep / skip / untouched produce at most a marker
                sinks.write(name, 0, lp.marker)
    except H3QuantError as exc:
        entry["error"] = exc.reason
        failures.append({"name": lp.name, "error": exc.reason})
    progress(total)
    results[lp.name] = entry


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


def build_report(plan: ConvertPlan, results: dict[str, dict], elapsed: float) -> ConvertReport:
    for entry in results.values():
        if isinstance(entry.get("metrics"), Future):
            entry["metrics"] = entry["metrics"].result()
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
