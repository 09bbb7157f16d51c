"""Per-rank reads: each rank reads only the bytes of its own shard from the checkpoint.

A column shard is whole rows of ``[N, K]`` tensors: one contiguous byte range per row range. A
row (K) shard is the same column range of every row: one small read per row (``--no-mmap``:
one ``pread``-style read each; mmap: a copy of just those bytes, after which the mapped pages
are released so they do not linger in the rank's RSS). Per-row tensors (scales, biases) follow
the rows of a column shard and are read whole for a K shard; codebooks and scalar scales are
read whole. ``ShardReader.bytes_read`` counts what was read, so a test can check 1/N.

An ``int8_tensorwise_kn`` weight is stored ``[K, N]``: its column shard is a column range and its
row (K) shard a single contiguous byte range.

The shard becomes a ``LoadedLayer`` whose tensors are the slices (its ``out_features`` /
``in_features`` are the shard's), so the runtime's own ``quantized_linear`` and ``int8_grid``
work on it unchanged. The layer's marker and tensor set are checked exactly as ``load_layer``
checks a whole layer.
"""

from __future__ import annotations

import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.dtypes import itemsize, to_torch
from h3quant.formats.layers import Layer
from h3quant.formats import registry
from h3quant.runtime.loader import LoadedLayer, check_quantized
from h3quant.runtime.tp.plan import ColumnShard, LayerShape, RowShard, TpError

_ROW_TENSORS = ("weight_scale", "weight_s_channel", "bias")  # one value per output row


class ShardReader:
    """Reads slices of tensors of one open checkpoint and counts the bytes it read."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.bytes_read = 0

    def _bytes(self, info: TensorInfo, start: int, length: int):
        self.bytes_read += length
        return self.ckpt.file_of(info.name).read_bytes(info, start, length)

    def whole(self, info: TensorInfo) -> torch.Tensor:
        self.bytes_read += info.nbytes
        return self.ckpt.read(info.name)

    def rows(self, info: TensorInfo, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Rows ``[r0, r1)`` of each range along dim 0, concatenated (a copy)."""
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        parts = []
        for r0, r1 in ranges:
            if not 0 <= r0 <= r1 <= info.shape[0]:
                raise TpError(f"rows [{r0}, {r1}) outside {list(info.shape)}", tensor=info.name)
            buf = bytearray(self._bytes(info, r0 * row_bytes, (r1 - r0) * row_bytes))
            parts.append(_tensor(buf, info, (r1 - r0, *info.shape[1:])))
        self._release(info)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def columns(self, info: TensorInfo, c0: int, c1: int) -> torch.Tensor:
        """Columns ``[c0, c1)`` of a 2-D tensor: one read of ``(c1 - c0)`` elements per row."""
        if len(info.shape) != 2 or not 0 <= c0 <= c1 <= info.shape[1]:
            raise TpError(f"columns [{c0}, {c1}) outside {list(info.shape)}", tensor=info.name)
        n, k = info.shape
        item = itemsize(info.dtype)
        width = (c1 - c0) * item
        out = bytearray(n * width)
        view = memoryview(out)
        for r in range(n if width else 0):
            view[r * width:(r + 1) * width] = self._bytes(info, (r * k + c0) * item, width)
        self._release(info)
        return _tensor(out, info, (n, c1 - c0))

    def _release(self, info: TensorInfo) -> None:
        self.ckpt.file_of(info.name).release_pages(info)


def _tensor(buf: bytearray, info: TensorInfo, shape) -> torch.Tensor:
    dtype = to_torch(info.dtype)
    if not len(buf):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def layer_shape(layer: Layer, role: str) -> LayerShape:
    """The plan's view of a scanned (not yet read) layer."""
    w = layer.weight
    if w is None or len(w.shape) != 2:
        raise TpError("block linear has no 2-D weight", tensor=layer.tensor_name("weight"))
    n, k = w.shape
    fields = layer.fields
    align = 1
    if fields is not None:
        codec = registry.codec_for(fields, tensor=layer.name)
        n, k = codec.spec.reading.logical_shape((n, k), fields)  # a kn weight is stored [K, N]
        if codec.spec.reading.uses_convrot(fields):
            align = int(fields.get("convrot_groupsize", 256))
    return LayerShape(role, int(n), int(k), align)


def read_shard(reader: ShardReader, layer: Layer, shard: ColumnShard | RowShard) -> LoadedLayer:
    """The rank's slice of one layer as a LoadedLayer (see the module docstring)."""
    path = reader.ckpt.path
    fields = layer.fields
    if fields is not None:
        check_quantized(layer, fields, path)
    codec = registry.codec_for(fields, tensor=layer.name)
    pack = codec.spec.reading.logical_k(1, fields)  # logical input columns per stored weight column
    stored_kn = "weight" in codec.spec.storage.transposed_outputs  # the weight is stored [K, N]
    tensors = {}
    for suffix, info in layer.tensors.items():
        if suffix == "comfy_quant":
            continue
        if suffix == "weight" and stored_kn:
            # stored [K, N]: a column shard is a column range, a row (K) shard one byte range
            if isinstance(shard, ColumnShard):
                parts = [reader.columns(info, r0, r1) for r0, r1 in shard.rows]
                tensors[suffix] = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
            else:
                tensors[suffix] = reader.rows(info, ((shard.k0, shard.k1),))
            continue
        per_row = suffix in _ROW_TENSORS and len(info.shape) >= 1 and info.numel > 1
        if isinstance(shard, ColumnShard):
            if suffix in ("weight", "weight_s_rel") or per_row:
                tensors[suffix] = reader.rows(info, shard.rows)
            else:
                tensors[suffix] = reader.whole(info)
        elif suffix == "weight":
            div = pack
            tensors[suffix] = reader.columns(info, shard.k0 // div, shard.k1 // div)
        elif suffix == "weight_s_rel":
            assert fields is not None  # W4A8's tensor: a quantized layer
            gs = int(fields.get("group_size", 16))
            if shard.k0 % gs or shard.k1 % gs:
                raise TpError(f"K slice [{shard.k0}, {shard.k1}) cuts W4A8 scale groups of {gs}",
                              tensor=info.name)
            tensors[suffix] = reader.columns(info, shard.k0 // gs, shard.k1 // gs)
        else:
            tensors[suffix] = reader.whole(info)
    if fields is None and any(t.dtype not in (torch.bfloat16, torch.float16, torch.float32,
                                              torch.float64) for t in tensors.values()):
        raise TpError("a layer without quantization marker holds non-float tensors",
                      tensor=layer.name)
    return LoadedLayer(layer.name, tensors, dict(fields) if fields else None, layer.source)
