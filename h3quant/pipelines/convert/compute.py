"""Compute one layer's output tensors in bounded memory and hand them to a sink as they come.

The target's codec does the tensor work. Row-chunked codecs (int8 and bf16: per-row scales make
chunks independent, so the codes equal one encoder call on the whole weight) work on row chunks,
each output written at its rows' offset; the others (W4A8: its codebook is chosen per layer)
encode the whole layer at once. A few evenly spaced rows of the source and the result are kept
for the error report.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from h3quant.errors import FormatError
from h3quant.pipelines.convert.io import Reader
from h3quant.formats import registry
from h3quant.formats.container.dtypes import itemsize
from h3quant.formats.transpose import RowTransposer
from h3quant.pipelines.convert.layers import LayerPlan
from h3quant.pipelines.convert.options import REPORT_ROWS, ConvertOptions

CHUNK_ELEMS = 1 << 20  # weight elements per row chunk (4 MB as fp32)
CALIBRATED_ROWS = 2048  # rows per chunk at least, with error feedback


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
    """Decode rows of a layer's input weight to a float tensor, through the input's codec."""

    def __init__(self, lp: LayerPlan, reader: Reader):
        self.lp, self.reader = lp, reader
        self.f = lp.src_fields
        self.t = lp.inputs
        self.codec = registry.codec_for(self.f, tensor=lp.name)
        row_names, whole_names = self.codec.decoder.source_tensors(self.f, self.t)
        self._rows = [self.t[n] for n in row_names]
        self._whole = {n: reader.whole(self.t[n]).clone() for n in whole_names}
        # Stored [K, N] (int8_tensorwise_kn): layer rows are columns, sliced from one read of
        # the tensor (one layer's codes; mapped pages are dropped after the last row).
        self._cols = {n: reader.whole(self.t[n]) for n in self.codec.spec.storage.column_sources}
        # row-indexed views the codec derives from whole tensors (nvfp4's unswizzled scales)
        self._views = self.codec.decoder.row_views(self._whole, self.f)

    def used(self) -> list:
        """The tensors read row by row (what progress, prefetch and release cover)."""
        return list(self._rows)

    def prefetch(self, r0: int, r1: int) -> None:
        for info in self._rows:
            self.reader.prefetch_rows(info, r0, r1)

    def release(self, r0: int, r1: int) -> None:
        for info in self._rows:
            self.reader.release_rows(info, r0, r1)
        if r1 >= self.lp.n:
            for name in self._cols:
                self.reader.release(self.t[name])

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)``: the stored float rows (no copy) or the dequantized fp32 rows."""
        rows: dict[str, Any] = {info.name[len(self.lp.name) + 1:]: self.reader.rows(info, r0, r1)
                for info in self._rows}
        rows.update({name: col[:, r0:r1].t() for name, col in self._cols.items()})
        if self.codec.spec.runtime.needs_row0:  # block scales laid out across rows
            rows["_row0"] = r0
        rows.update({name: view[r0:r1] for name, view in self._views.items()})
        return self.codec.decoder.decode_rows(rows, self._whole, self.f)


def _chunked(n: int, k: int, task, workers: int, pool: ThreadPoolExecutor | None,
             step: int | None = None):
    """Yield ``task(r0, r1)`` results in row order; up to ``workers + 1`` chunks in flight."""
    step = step or rows_per_chunk(k)
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


def _check_finite(lp: LayerPlan, out: dict[str, torch.Tensor], r0: int) -> None:
    """A NaN or inf in the source shows up as a non-finite fp32 scale: refuse the layer."""
    for t in out.values():
        if t.dtype == torch.float32 and t.dim() and not torch.isfinite(t).all():
            bad = torch.isfinite(t.reshape(t.shape[0], -1)).all(1).logical_not().nonzero()
            row = int(bad[0, 0]) + r0
            raise FormatError(f"weight holds NaN or inf (row {row}); cannot quantize",
                              tensor=lp.name)


def _planned(lp: LayerPlan) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each planned output of the layer by suffix (the marker aside): (shape, dtype)."""
    planned = {e.name[len(lp.name) + 1:]: (tuple(e.shape), e.dtype) for e in lp.produced.values()}
    planned.pop("comfy_quant", None)
    return planned


def _check_shapes(lp: LayerPlan, out: dict[str, torch.Tensor], planned: dict, want, where: str = ""
                  ) -> None:
    """``FormatError`` unless ``out`` holds exactly the planned suffixes, each of the shape
    ``want(suffix, planned shape)`` gives."""
    if set(out) != set(planned) or not all(tuple(v.shape) == want(sfx, planned[sfx][0])
                                           for sfx, v in out.items()):
        got = ", ".join(f"{sfx} {list(v.shape)}" for sfx, v in sorted(out.items()))
        raise FormatError(f"encoder returned {got}{where}; the plan expects "
                          + ", ".join(f"{sfx} {list(sh)}" for sfx, (sh, _) in sorted(planned.items())),
                          tensor=lp.name)


def _check_planned(lp: LayerPlan, out: dict[str, torch.Tensor], n: int,
                   unrowed: tuple[str, ...], transposed: tuple[str, ...] = ()) -> None:
    """The encoder returned exactly the planned tensors: ``n`` rows of each rowed one (of a
    transposed one: ``n`` rows of its planned [K, N] transpose)."""
    def want(suffix: str, shape: tuple) -> tuple:
        if suffix in transposed:
            return (n, shape[0])
        return shape if suffix in unrowed else (n, *shape[1:])

    _check_shapes(lp, out, _planned(lp), want)


def _row_bytes(lp: LayerPlan, suffix: str) -> int:
    e = lp.produced[f"{lp.name}.{suffix}"]
    per = 1
    for d in e.shape[1:]:
        per *= d
    return per * itemsize(e.dtype)


def encode_chunked(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                   workers: int = 1, pool=None, calibration=None) -> Samples:
    """Row-chunked codecs: each chunk's outputs are written at their rows' offsets."""
    n, k = lp.n, lp.k
    codec, marker = opts.codec, lp.out_fields
    samples = Samples.for_layer(n, opts.report)
    lock = threading.Lock()
    # error feedback walks every column once per chunk: calibrated chunks are larger (the rows
    # of a chunk share each column step and its GEMMs); the spans depend on the shape alone
    # (not on --workers), so the same input gives the same bytes
    step = rows_per_chunk(k) if calibration is None else max(rows_per_chunk(k), CALIBRATED_ROWS)

    def task(r0, r1):
        if r1 < n:
            src.prefetch(r1, min(n, r1 + step))
        w = src.rows(r0, r1)
        out = codec.encoder.encode(w, marker, opts.rotation, calibration=calibration) \
            if calibration is not None else codec.encoder.encode(w, marker, opts.rotation)
        with lock:
            samples.take(r0, r1, w, **out)
        src.release(r0, r1)
        return r0, r1, out

    # pre-transposed outputs (the NPU layout): rows are gathered into slabs and written as
    # columns of the [K, N] tensor, never holding the whole layer
    transposers = {sfx: RowTransposer(n, k, functools.partial(sink.write, f"{lp.name}.{sfx}"))
                   for sfx in codec.spec.storage.transposed_outputs}
    for r0, r1, out in _chunked(n, k, task, workers, pool, step):
        _check_planned(lp, out, r1 - r0, codec.spec.encoding.unrowed_outputs, codec.spec.storage.transposed_outputs)
        if codec.spec.quantized:
            _check_finite(lp, out, r0)
        for suffix, tensor in out.items():
            if suffix in transposers:
                transposers[suffix].add(tensor)
            else:
                sink.write_tensor(f"{lp.name}.{suffix}", tensor, r0 * _row_bytes(lp, suffix))
        progress(sum(i.nbytes for i in src.used()) * (r1 - r0) // max(n, 1))
    for t in transposers.values():
        t.finish()
    if lp.marker is not None:
        sink.write_tensor(f"{lp.name}.comfy_quant", _marker_tensor(lp))
    return samples


def encode_whole(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                 workers: int = 1, pool=None, calibration=None) -> Samples:
    """Codecs that need the whole layer at once (W4A8 fits its codebook per layer)."""
    n, k = lp.n, lp.k
    if lp.src_fields is None:
        w = src.rows(0, n)
    else:
        w = torch.empty(n, k, dtype=torch.float32)
        for r0, r1, rows in _chunked(n, k, lambda a, b: (a, b, src.rows(a, b)), workers, pool):
            w[r0:r1] = rows
    if calibration is not None:
        out = opts.codec.encoder.encode(w, lp.out_fields, opts.rotation, pool=pool, calibration=calibration)
    else:
        out = opts.codec.encoder.encode(w, lp.out_fields, opts.rotation, pool=pool)
    _check_finite(lp, {s: v for s, v in out.items() if s not in opts.codec.spec.encoding.unrowed_outputs}, 0)
    _check_planned(lp, out, n, opts.codec.spec.encoding.unrowed_outputs)
    samples = Samples.for_layer(n, opts.report)
    unrowed = opts.codec.spec.encoding.unrowed_outputs
    cols = opts.codec.spec.encoding.sampled_by_column  # stored [*, N]: sampled as rows
    samples.take(0, n, w, **{s: (v.t() if s in cols else v) for s, v in out.items()
                             if s not in unrowed or s in cols})
    samples.extra = {s: v for s, v in out.items() if s in unrowed and s not in cols}
    if samples.idx is not None and (unrowed or opts.codec.spec.runtime.needs_row0):
        samples.extra["_rows"] = samples.idx  # which rows were sampled (scales stored by tile)
    del w
    src.release(0, n)
    progress(sum(i.nbytes for i in src.used()))
    tensors = {f"{lp.name}.{suffix}": tensor for suffix, tensor in out.items()}
    tensors[f"{lp.name}.comfy_quant"] = _marker_tensor(lp)
    sink.write_behind(tensors)  # written while the next layer encodes
    return samples


def _stream_step(k: int, multiple: int) -> int:
    """Rows per streamed chunk: about ``CHUNK_ELEMS`` weights, a multiple of ``multiple``."""
    step = rows_per_chunk(k)
    return max(multiple, (step + multiple - 1) // multiple * multiple)


def encode_streamed(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                    workers: int = 1, pool=None) -> Samples:
    """Codecs with one layer-wide value (fp8's and nvfp4's amax; mxfp8 only needs 128-row
    chunks), in two passes over the rows: the first gives the value, the second encodes row
    chunks with it and writes each output at its rows' offset. Memory holds a few chunks, as
    ``encode_chunked`` does; the bytes equal one ``encode`` of the whole layer. Outputs that
    are not indexed by row (a scalar, the blocked scale tiles) are gathered in memory (small)
    and written at the end, as ``encode_whole`` writes them."""
    n, k = lp.n, lp.k
    codec, marker = opts.codec, lp.out_fields
    spec = codec.spec
    step = _stream_step(k, spec.encoding.chunk_rows)
    value = None
    if codec.spec.encoding.scans:  # the first pass: the layer-wide value

        def scan(r0, r1):
            part = codec.encoder.scan_rows(src.rows(r0, r1))
            src.release(r0, r1)
            return part

        value = codec.encoder.layer_value(list(_chunked(n, k, scan, workers, pool, step)))
    planned = _planned(lp)
    unrowed = spec.encoding.unrowed_outputs
    gathered: dict[str, torch.Tensor] = {}
    samples = Samples.for_layer(n, opts.report)
    lock = threading.Lock()

    def task(r0, r1):
        if r1 < n:
            src.prefetch(r1, min(n, r1 + step))
        w = src.rows(r0, r1)
        out = codec.encoder.encode_rows(w, marker, opts.rotation, value)
        with lock:
            samples.take(r0, r1, w, **{s: v[:r1 - r0] for s, v in out.items() if s not in unrowed})
        src.release(r0, r1)
        return r0, r1, out

    for r0, r1, out in _chunked(n, k, task, workers, pool, step):
        _check_streamed(lp, out, planned, r0, r1)
        _check_finite(lp, {s: v for s, v in out.items() if s not in unrowed}, r0)
        for suffix, tensor in out.items():
            if suffix not in unrowed:
                sink.write_tensor(f"{lp.name}.{suffix}", tensor, r0 * _row_bytes(lp, suffix))
            elif tensor.dim() == 0:
                gathered[suffix] = tensor
            else:
                whole = gathered.get(suffix)
                if whole is None:  # zero bytes (an e8m0 tensor has no 0.0 to fill with)
                    whole = torch.empty(planned[suffix][0], dtype=tensor.dtype)
                    whole.view(torch.uint8).zero_()
                    gathered[suffix] = whole
                whole[r0:r0 + tensor.shape[0]] = tensor
        progress(sum(i.nbytes for i in src.used()) * (r1 - r0) // max(n, 1))
    for suffix, tensor in gathered.items():
        sink.write_tensor(f"{lp.name}.{suffix}", tensor)
    samples.extra = dict(gathered)
    if samples.idx is not None and (unrowed or codec.spec.runtime.needs_row0):
        samples.extra["_rows"] = samples.idx  # which rows were sampled (scales stored by tile)
    if lp.marker is not None:
        sink.write_tensor(f"{lp.name}.comfy_quant", _marker_tensor(lp))
    return samples


def _check_streamed(lp: LayerPlan, out: dict[str, torch.Tensor], planned: dict, r0: int,
                    r1: int) -> None:
    """A streamed chunk's outputs are the planned tensors' rows from ``r0``: ``r1 - r0`` of
    them (the last chunk: up to the planned end, padding included); a 0-dim one whole."""
    def want(suffix: str, shape: tuple) -> tuple:
        if not shape:
            return shape
        return ((shape[0] - r0 if r1 >= lp.n else r1 - r0), *shape[1:])

    _check_shapes(lp, out, planned, want, f" for rows {r0}..{r1}")


def encode_layer(lp: LayerPlan, src: SourceRows, opts: ConvertOptions, sink, progress,
                 workers: int = 1, pool=None, calibration=None) -> Samples:
    """Encode one planned layer with the target's codec (``calibration``: the layer's
    statistics, for a codec that calibrates; None rounds to nearest)."""
    if opts.codec.spec.encoding.chunked:
        return encode_chunked(lp, src, opts, sink, progress, workers, pool, calibration)
    if opts.codec.spec.encoding.streamed and calibration is None:
        return encode_streamed(lp, src, opts, sink, progress, workers, pool)
    return encode_whole(lp, src, opts, sink, progress, workers, pool, calibration)


def _marker_tensor(lp: LayerPlan) -> torch.Tensor:
    assert lp.marker is not None  # called for layers that write a marker
    return torch.frombuffer(bytearray(lp.marker), dtype=torch.uint8)
