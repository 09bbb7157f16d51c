"""Compute one layer's output tensors in bounded memory and hand them to a sink as they come.

int8 targets and bf16 work on row chunks (per-row scales make chunks independent, so the codes
equal one ``encode_int8`` call on the whole weight); W4A8 encodes the whole layer at once (its
codebook is chosen per layer). A few evenly spaced rows of the source and the result are kept
for the error report.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from h3quant.errors import FormatError
from h3quant.pipelines.convert.io import Reader
from h3quant.pipelines.convert.layers import INT8, W4A8, LayerPlan
from h3quant.pipelines.convert.options import REPORT_ROWS, W4A8_GROUP, ConvertOptions

CHUNK_ELEMS = 1 << 20  # weight elements per row chunk (4 MB as fp32)
COPY_CHUNK = 16 << 20  # bytes per copy chunk


def rows_per_chunk(k: int) -> int:
    return max(1, CHUNK_ELEMS // max(k, 1))


def sample_rows(n: int, count: int = REPORT_ROWS) -> torch.Tensor:
    """``count`` evenly spaced row indices of ``n`` (all rows when ``n <= count``)."""
    if n <= count:
        return torch.arange(n)
    return torch.linspace(0, n - 1, count, dtype=torch.float64).round().long().unique()


@dataclass
class Samples:
    """Sampled rows: the source weight (fp32) and the stored result, for the report."""

    idx: torch.Tensor | None  # None: no report, nothing kept
    parts: list = field(default_factory=list)  # (first row, ref rows, {name: rows})
    extra: dict = field(default_factory=dict)  # whole small tensors (a W4A8 codebook)

    @classmethod
    def for_layer(cls, n: int, wanted: bool) -> "Samples":
        return cls(sample_rows(n) if wanted else None)

    def take(self, r0: int, r1: int, ref: torch.Tensor, **out: torch.Tensor) -> None:
        if self.idx is None:
            return
        sel = self.idx[(self.idx >= r0) & (self.idx < r1)] - r0
        if sel.numel():
            self.parts.append((r0, ref[sel].float().clone(),
                               {k: v[sel].clone() for k, v in out.items()}))

    def cat(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The sampled rows in row order (chunks may finish in any order on the workers)."""
        parts = sorted(self.parts, key=lambda p: p[0])
        ref = torch.cat([p[1] for p in parts])
        out = {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
        return ref, {**out, **self.extra}


class SourceRows:
    """Decode rows of a layer's input weight to a float tensor (plain, int8 or W4A8 input)."""

    def __init__(self, lp: LayerPlan, reader: Reader):
        self.lp, self.reader = lp, reader
        self.f = lp.src_fields
        self.t = lp.inputs
        self._scalar = None
        self._codebook = None
        if self.f and self.f["format"] == INT8 and self.t["weight_scale"].numel == 1:
            self._scalar = reader.whole(self.t["weight_scale"]).float().reshape(())
        if self.f and self.f["format"] == W4A8 and "weight_codebook" in self.t:
            self._codebook = reader.whole(self.t["weight_codebook"]).clone()

    def used(self) -> list:
        names = ["weight"]
        if self.f and self.f["format"] == INT8 and self._scalar is None:
            names.append("weight_scale")
        if self.f and self.f["format"] == W4A8:
            names += ["weight_s_rel", "weight_s_channel"]
        return [self.t[n] for n in names]

    def prefetch(self, r0: int, r1: int) -> None:
        for info in self.used():
            self.reader.prefetch_rows(info, r0, r1)

    def release(self, r0: int, r1: int) -> None:
        for info in self.used():
            self.reader.release_rows(info, r0, r1)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)``: the stored float rows (no copy) or the dequantized fp32 rows."""
        rd, t, f = self.reader, self.t, self.f
        if f is None:
            return rd.rows(t["weight"], r0, r1)
        if f["format"] == INT8:
            from h3quant.formats.int8 import decode_int8

            q = rd.rows(t["weight"], r0, r1)
            s = (self._scalar.expand(r1 - r0, 1) if self._scalar is not None
                 else rd.rows(t["weight_scale"], r0, r1).reshape(-1, 1))
            return decode_int8(q, s, convrot=bool(f.get("convrot")),
                               group_size=f.get("convrot_groupsize", 256), dtype=torch.float32)
        from h3quant.formats.w4a8 import decode_w4a8

        local = {"weight": rd.rows(t["weight"], r0, r1).view(torch.int8),
                 "weight_s_rel": rd.rows(t["weight_s_rel"], r0, r1),
                 "weight_s_channel": rd.rows(t["weight_s_channel"], r0, r1).reshape(-1)}
        if self._codebook is not None:
            local["weight_codebook"] = self._codebook
        return decode_w4a8(local, group_size=f.get("group_size", 16),
                           convrot_groupsize=f.get("convrot_groupsize", 256), dtype=torch.float32)


def _chunked(n: int, k: int, task, workers: int, pool: ThreadPoolExecutor | None):
    """Yield ``task(r0, r1)`` results in row order; up to ``workers + 1`` chunks in flight."""
    step = rows_per_chunk(k)
    spans = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]
    if pool is None or workers <= 1:
        for r0, r1 in spans:
            yield task(r0, r1)
        return
    pending: deque = deque()
    try:
        for span in spans:
            pending.append(pool.submit(task, *span))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # on an error or interrupt: drop queued chunks, never wait for running ones
        for fut in pending:
            fut.cancel()


def _check_scale(lp: LayerPlan, s: torch.Tensor, r0: int) -> None:
    if not torch.isfinite(s).all():
        bad = int((~torch.isfinite(s)).nonzero()[0, 0]) + r0
        raise FormatError(f"weight holds NaN or inf (row {bad}); cannot quantize", tensor=lp.name)


def encode_int8_layer(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                      workers: int = 1, pool=None) -> Samples:
    from h3quant.formats.int8 import encode_int8

    n, k, g = lp.n, lp.k, opts.group_size
    samples = Samples.for_layer(n, opts.report)
    scale = torch.empty(n, 1, dtype=torch.float32)
    lock = threading.Lock()
    step = rows_per_chunk(k)

    def task(r0, r1):
        if r1 < n:
            src.prefetch(r1, min(n, r1 + step))
        w = src.rows(r0, r1)
        q, s = encode_int8(w, convrot=opts.convrot, group_size=g, per_row=True,
                           method=opts.rotation)
        with lock:
            samples.take(r0, r1, w, q=q, s=s)
        src.release(r0, r1)
        return r0, r1, q, s

    wname = f"{lp.name}.weight"
    for r0, r1, q, s in _chunked(n, k, task, workers, pool):
        _check_scale(lp, s, r0)
        sink.write_tensor(wname, q, r0 * k)
        scale[r0:r1] = s.reshape(-1, 1)
        progress(sum(i.nbytes for i in src.used()) * (r1 - r0) // max(n, 1))
    sink.write_tensor(f"{lp.name}.weight_scale", scale)
    sink.write_tensor(f"{lp.name}.comfy_quant", _marker_tensor(lp))
    return samples


def decode_bf16_layer(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                      workers: int = 1, pool=None) -> Samples:
    n, k = lp.n, lp.k
    samples = Samples.for_layer(n, opts.report)
    lock = threading.Lock()

    def task(r0, r1):
        w = src.rows(r0, r1)
        out = w.to(torch.bfloat16)
        with lock:
            samples.take(r0, r1, w, w=out)
        src.release(r0, r1)
        return r0, r1, out

    for r0, r1, out in _chunked(n, k, task, workers, pool):
        sink.write_tensor(f"{lp.name}.weight", out, r0 * k * 2)
        progress(sum(i.nbytes for i in src.used()) * (r1 - r0) // max(n, 1))
    return samples


def encode_w4a8_layer(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                      workers: int = 1, pool=None) -> Samples:
    from h3quant.formats.w4a8 import encode_w4a8

    n, k = lp.n, lp.k
    if lp.src_fields is None:
        w = src.rows(0, n)
    else:
        w = torch.empty(n, k, dtype=torch.float32)
        for r0, r1, rows in _chunked(n, k, lambda a, b: (a, b, src.rows(a, b)), workers, pool):
            w[r0:r1] = rows
    out = encode_w4a8(w, group_size=W4A8_GROUP, convrot_groupsize=opts.group_size,
                      codebook="auto")
    if not torch.isfinite(out["weight_s_channel"]).all():
        raise FormatError("weight holds NaN or inf; cannot quantize", tensor=lp.name)
    planned = {e.name[len(lp.name) + 1:]: e for e in lp.produced.values()}
    planned.pop("comfy_quant", None)
    if set(out) != set(planned) or any(tuple(out[s].shape) != planned[s].shape for s in out):
        got = ", ".join(f"{s} {list(v.shape)}" for s, v in sorted(out.items()))
        raise FormatError(f"W4A8 encoder returned {got}; the plan expects "
                          + ", ".join(f"{s} {list(e.shape)}" for s, e in sorted(planned.items())),
                          tensor=lp.name)
    samples = Samples.for_layer(n, opts.report)
    samples.take(0, n, w, **{s: v for s, v in out.items() if s != "weight_codebook"})
    samples.extra = {"weight_codebook": out["weight_codebook"]}
    del w
    src.release(0, n)
    progress(sum(i.nbytes for i in src.used()))
    for suffix, tensor in out.items():
        sink.write_tensor(f"{lp.name}.{suffix}", tensor)
    sink.write_tensor(f"{lp.name}.comfy_quant", _marker_tensor(lp))
    return samples


def _marker_tensor(lp: LayerPlan) -> torch.Tensor:
    return torch.frombuffer(bytearray(lp.marker), dtype=torch.uint8)


def copy_tensor(item, reader: Reader, sink, progress) -> None:
    for start, data in reader.chunks(item.src, COPY_CHUNK):
        sink.write(item.out, start, data)
        progress(len(data))


CONVERTERS = {"int8": encode_int8_layer, "w4a8": encode_w4a8_layer, "bf16": decode_bf16_layer}
