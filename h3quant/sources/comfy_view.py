"""Take in official, diffusers and fp8 checkpoints: seen as ComfyUI's single file.

Every reader of a source or reference (``convert``, ``verify --reference``, ``verify --model
--reference``, ``plan``) opens it with ``open_as_comfy``, so each of them takes every layout
and format ``convert`` takes, through this one view. ``convert`` calls ``adopt_mapping`` on its
input's header; when the input is not already a
ComfyUI file with plain (non-fp8) weights, it converts a ``SourceView`` of it instead: an object
with the reading interface of a ``Checkpoint`` whose tensors carry ComfyUI's names, dtypes and
shapes, laid out as one single file. A renamed tensor is read straight from its shard (even copied
inside the kernel); a fused, regrouped, swapped or fp8 one is computed when first read, from its
own source tensors only (a fused q/k/v reads three tensors), and one big computed tensor is
held at a time (``CACHE_EXTRA``). Nothing is written beside the output, and converting an
official or diffusers checkpoint gives exactly the bytes converting the equivalent ComfyUI file
gives.

Row operations (``h3.naming``) move whole rows, so a BF16 source stays bit-exact. fp8
weights are decoded to fp32 (``float(code) * scale``, the scale per tensor or per
output row, as ComfyUI's scaled-fp8 loader multiplies it in) and seen as F32 by a quantized
target, or rounded once to BF16 (nearest even) for ``--to bf16``. An fp8 weight that
``convert`` leaves alone (``narrow``) keeps its codes byte for byte when it can: with one scale
per tensor (or none) and no rows moved, it is shown as a per-layer float8 layer (its codes, its
scale as an F32 ``weight_scale``, a ``comfy_quant`` marker and a header entry), the form
ComfyUI loads today; otherwise (a per-row scale, rows moved or fused) it is shown as BF16,
rounded once, and ``notes`` says why.
"""

from __future__ import annotations

import math
import struct
import threading
from collections import OrderedDict

from h3quant.errors import FormatError, MarkerError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.dtypes import float_value
from h3quant.formats import registry
from h3quant.formats.markers import MARKER_SUFFIX, marker_bytes
from h3quant.h3.naming import (
    COPY,
    DEINTERLEAVE_QKV,
    FUSE_QKV,
    SWAP_HALVES,
    Detection,
    Mapping,
    Target,
    check_fp8_scales,
    detect,
    plan_mapping,
    staged_entries,
)
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.virtual import VirtualFile
from h3quant.formats.markers import HEADER_KEY, header_metadata_value, parse_header_metadata
from h3quant.sources.header import check_scale, has_config, headers


def adopt_mapping(ckpt: Checkpoint, naming: str = "auto") -> tuple[Detection, Mapping]:
    """The input's naming (detected, or ``naming``) and its map onto ComfyUI's names."""
    tensors = headers(ckpt)
    det = detect(tensors, [sf.path.name for sf in ckpt.files] if ckpt.is_sharded else None,
                 has_config(ckpt))
    if naming != "auto":
        det = Detection(naming, "chosen with --naming", det.fp8)
    mapping = plan_mapping(tensors, det.naming)
    check_fp8_scales(mapping, tensors)
    return det, mapping


def decode_fp8(ckpt: Checkpoint, src):
    """fp8 codes -> fp32 (codes exact; code x scale rounded once), the scale (per tensor or
    per row) multiplied in."""
    import torch

    from h3quant.errors import FindingError
    from h3quant.formats.check import fp8_weight_violation

    codes = ckpt.read(src.name)
    s = None if src.scale is None else ckpt.read(src.scale).to(torch.float32)
    if s is not None:
        check_scale(s, src.scale, "; nothing written")
    # the one rule validate --deep applies: decoded as ComfyUI decodes it, every value finite
    v = fp8_weight_violation(codes, s)
    if v is not None:
        raise FindingError(f"source weight decoded from fp8: {v.message}; nothing "
                           "written", tensor=src.name, code=v.code)
    if s is None:
        return codes.to(torch.float32)
    s = s.reshape(()) if s.numel() == 1 else s.reshape((-1,) + (1,) * (codes.dim() - 1))
    # as ComfyUI's scaled-fp8 loader and kitchen's dequantize_per_tensor_fp8 decode it: codes
    # to fp32, times the fp32 scale, in place (one fp32 copy)
    return codes.to(torch.float32).mul_(s)


def _read(ckpt: Checkpoint, src):
    return decode_fp8(ckpt, src) if src.fp8 else ckpt.read(src.name)


def build_target(ckpt: Checkpoint, t: Target):
    """The ComfyUI tensor ``t`` from its sources (rows moved, never recomputed)."""
    import torch

    if t.op == FUSE_QKV:
        return torch.cat([_read(ckpt, s) for s in t.sources], dim=0)
    x = _read(ckpt, t.sources[0])
    if t.op == SWAP_HALVES:
        half = x.shape[0] // 2
        return torch.cat([x[half:], x[:half]], dim=0)
    if t.op == DEINTERLEAVE_QKV:
        rows = x.shape[0]
        d = rows // (3 * t.heads)
        return x.reshape(t.heads, 3, d, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    return x


# Computed tensors held for the next reads: always the latest, older ones only while they add up
# to at most CACHE_EXTRA bytes (a layer's bias or marker read between chunks of its weight stays;
# a second big weight does not: a full-size fused q/k/v is 231 MB in BF16).
CACHE_EXTRA = 64 << 20
ALIGN = 64


class _ViewFile(VirtualFile):
    """The one file of a ``SourceView``: the reading interface ``convert`` uses of a
    ``SafetensorsFile`` (``read_bytes``, ``release_pages``, ``prefetch``, ``forward``)."""

    use_mmap = False  # reads go through the reader's lock: a tensor is computed once

    def forward(self, info: TensorInfo):
        """(real file, real TensorInfo) of a tensor stored unchanged in a shard, else None."""
        return self.view.forwarded(info.name)

    def read_bytes(self, info: TensorInfo, start: int = 0, length: int | None = None):
        real = self.forward(info)
        if real is not None:
            return real[0].read_bytes(real[1], start, length)
        data = self.view.computed(info.name)
        end = len(data) if length is None else start + length
        return data[start:end]

    def uncached(self, info: TensorInfo):
        """A computed tensor's whole bytes, built for one reader and not cached (a copied
        tensor read while a layer's weight is cached would otherwise evict it); None for a
        tensor stored in a shard."""
        if self.forward(info) is not None:
            return None
        return self.view.computed(info.name, cache=False)

    def release_pages(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        real = self.forward(info)
        if real is not None:
            real[0].release_pages(real[1], start, length)

    def prefetch(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        real = self.forward(info)
        if real is not None:
            real[0].prefetch(real[1], start, length)

    def check_unchanged(self, **_) -> None:
        self.view.source.check_unchanged()

    def close(self) -> None:
        pass


class SourceView:
    """A checkpoint in another naming (or with fp8 weights), seen as ComfyUI's single file.

    It has what ``convert`` reads of a ``Checkpoint``: ``path``, ``files`` (one), ``tensors``
    (ComfyUI names -> ``TensorInfo`` in a virtual file), ``metadata``, ``read``, ``read_bytes``,
    ``file_of``, ``check_unchanged``; ``input_files`` lists the real files, which the output
    rules protect."""

    is_sharded = False
    index_path = None

    def __init__(self, source: Checkpoint, mapping: Mapping, quantized_target: bool,
                 narrow: frozenset[str] = frozenset()):
        self.source = source
        self.mapping = mapping
        self.path = source.path
        self.findings: list = []
        self.index_metadata: dict = {}
        self.input_files = [sf.path for sf in source.files] + (
            [source.index_path] if source.index_path else [])
        name = source.path.name if source.path.suffix == ".safetensors" \
            else source.path.name + ".safetensors"
        self._file = _ViewFile(self, source.path.parent / name)
        self.files = [self._file]
        self._entries = staged_entries(mapping, quantized_target)
        self._targets = {t.name: t for t in mapping.targets}
        # fp8 weights copied, not re-encoded: kept as float8 layers where their stored form
        # allows it (``_kept``: layer -> marker; ``_extra``: their scale and marker tensors),
        # else BF16 (rounded once), never widened to F32.
        self._kept: dict[str, dict] = {}
        self._extra: dict[str, tuple[str, tuple[int, ...], bytes, str]] = {}
        self.notes: list[str] = []
        for name in sorted(narrow):
            if name in self._entries and self._targets_fp8(mapping, name):
                why = self._keep(name)
                if why is not None:
                    self._entries[name] = ("BF16", self._entries[name][1])
                    self.notes.append(f"{name}: {why}; written as BF16 (rounded once)")
        if self._kept:
            self.notes.append(f"{len(self._kept)} fp8 layer(s) convert leaves alone kept in "
                              "their float8 codes and scale (byte for byte)")
        # Replaced tensors (``replace``): name -> (dtype, shape, compute, base); hidden tensors
        # and the layers whose header marker entry no longer applies.
        self._replaced: dict[str, tuple] = {}
        self._hidden: set[str] = set()
        self._unmarked: set[str] = set()
        self.lora = None  # a convert.lora.LoraSet, once ``convert.bake`` has applied one
        self.extra_metadata: dict[str, str] = {}  # header keys added to the source's
        self._cache: OrderedDict[str, memoryview] = OrderedDict()
        self._lock = threading.Lock()
        self._layout()

    @staticmethod
    def _targets_fp8(mapping: Mapping, name: str) -> bool:
        return any(t.name == name and t.fp8 for t in mapping.targets)

    def _keep(self, name: str) -> str | None:
        """Show fp8 weight ``name`` as a per-layer float8 layer, codes and scale unchanged;
        the reason it cannot be (None when it is kept)."""
        t = self._targets[name]
        src = t.sources[0]
        marker = registry.kept_marker(src.dtype)
        if marker is None:
            return f"fp8 codes of {src.dtype} have no per-layer float8 format"
        if t.op != COPY or len(t.sources) != 1 or len(src.shape) != 2:
            return "its rows are moved or fused to fit ComfyUI's layout, so its codes cannot be kept"
        scale = 1.0
        if src.scale is not None:
            info = self.source.info(src.scale)
            if math.prod(info.shape) != 1:
                return "its fp8 scale is per row (ComfyUI's float8 layers hold one per tensor)"
            value = float_value(bytes(self.source.read_bytes(src.scale)), info.dtype)
            if value is None:  # the naming rules (N305) let only F32 / BF16 / F16 scales here
                raise FormatError(f"fp8 scale is {info.dtype}", code="N305")
            scale = value
            if not (scale > 0 and scale < float("inf")):  # decoding it reports N305
                return "its fp8 scale is not a finite positive value"
        layer = name[: -len(".weight")]
        stem = f"{layer}."
        if any(n.startswith(stem) and n != name and n[len(stem):] in ("weight_scale", "comfy_quant")
               for n in self._entries):
            return "its layer already holds a weight_scale or marker tensor"
        self._entries[name] = (src.dtype, tuple(src.shape))
        self._kept[layer] = marker
        self._extra[f"{layer}.weight_scale"] = ("F32", (), struct.pack("<f", scale), src.name)
        mbytes = marker_bytes(marker)
        self._extra[layer + MARKER_SUFFIX] = ("U8", (len(mbytes),), mbytes, src.name)
        return None

    def unkeep(self, layers) -> None:
        """Show the kept fp8 layers among ``layers`` as BF16 again (a LoRA merges into them)."""
        for layer in sorted(set(layers) & set(self._kept)):
            del self._kept[layer]
            del self._extra[f"{layer}.weight_scale"]
            del self._extra[layer + MARKER_SUFFIX]
            name = f"{layer}.weight"
            self._entries[name] = ("BF16", self._entries[name][1])
            self.notes.append(f"{name}: a LoRA is merged into it; written as BF16 (merged in "
                              "float, rounded once)")
        self._layout()

    @property
    def kept(self) -> frozenset[str]:
        """The layers shown as float8 layers with their source codes and scale."""
        return frozenset(self._kept)

    def _layout(self) -> None:
        """Place the tensors in the virtual file, in the order their sources lie in the shards."""
        def first_source(t: Target):
            info = self.source.info(t.sources[0].name)
            return str(info.file), info.begin
        def place(name: str):
            if name in self._extra:  # a kept layer's scale and marker: right after its codes
                info = self.source.info(self._extra[name][3])
                return str(info.file), info.begin, 1, name
            return (*first_source(self._targets[name]), 0, name)
        offset = 0
        infos = {}
        for name in sorted(list(self._targets) + list(self._extra), key=place):
            if name in self._hidden:
                continue
            if name in self._extra:
                dtype, shape = self._extra[name][:2]
            else:
                dtype, shape = self._replaced.get(name, self._entries[name])[:2]
            nbytes = _nbytes(dtype, shape)
            infos[name] = TensorInfo(name, dtype, tuple(shape), offset, offset + nbytes,
                                     self._file.path)
            offset += -(-nbytes // ALIGN) * ALIGN
        self.tensors = dict(sorted(infos.items()))
        self._cache.clear()

    def replace(self, name: str, dtype: str, shape: tuple[int, ...], compute, base,
                hide: tuple[str, ...] = (), unmark: str | None = None) -> None:
        """Show ``name`` as ``compute()`` (a tensor of ``dtype`` and ``shape``; ``base()`` is the
        tensor without the change, for reports); hide the tensors ``hide``; drop layer ``unmark``
        from the header's marker table (its weight is no longer stored quantized)."""
        self._replaced[name] = (dtype, tuple(shape), compute, base)
        self._hidden.update(hide)
        if unmark:
            self._unmarked.add(unmark)
        self._layout()

    def current(self, name: str):
        """(a function giving ``name`` as the view shows it now, one giving it before any
        replacement): what a further ``replace`` builds on."""
        if name in self._replaced:
            return self._replaced[name][2], self._replaced[name][3]
        return (lambda: self.stored(name)), (lambda: self.stored(name))

    def exact(self, name: str):
        """Tensor ``name`` from its sources before any rounding (an fp8 weight: its fp32
        decode), for a merge that rounds once."""
        return build_target(self.source, self._targets[name])

    def release_rows(self, name: str):
        """A function dropping the mapped pages of rows ``[r0, r1)`` of ``name``'s source (a
        plain rename; a no-op for computed ones)."""
        src = self.source_name(name)
        if src is None:
            return lambda r0, r1: None
        info, sf = self.source.info(src), self.source.file_of(src)
        row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        return lambda r0, r1: sf.release_pages(info, r0 * row, (r1 - r0) * row) if row else None

    def stored(self, name: str):
        """Tensor ``name`` as the mapping alone gives it (no replacement), in its view dtype."""
        from h3quant.formats.container.dtypes import to_torch

        if name.endswith(".weight") and name[: -len(".weight")] in self._kept:
            return self.source.read(self._targets[name].sources[0].name)  # the codes as stored
        x = build_target(self.source, self._targets[name])
        want = to_torch(self._entries[name][0])
        return x if x.dtype == want else x.to(want)  # fp8 decoded: F32, or rounded once to BF16

    # -- Checkpoint's reading interface ---------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        meta = self.source.metadata
        if self.extra_metadata:  # keys a transformation of the tensors adds (smoothing)
            meta = {**meta, **self.extra_metadata}
        if not self._kept and (not self._unmarked or HEADER_KEY not in meta):
            return meta
        meta = dict(meta)
        try:
            layers = parse_header_metadata(meta) or {}
        except MarkerError:
            return meta  # convert repairs (replaces) an unparseable table itself
        kept = {k: v for k, v in layers.items() if k not in self._unmarked}
        kept.update(self._kept)
        if kept:
            meta[HEADER_KEY] = header_metadata_value(kept)
        else:
            del meta[HEADER_KEY]
        return meta

    @property
    def total_bytes(self) -> int:
        return self.source.total_bytes

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def file_of(self, name: str) -> _ViewFile:
        self.info(name)
        return self._file

    def read(self, name: str):
        import torch

        from h3quant.formats.container.dtypes import to_torch

        info = self.info(name)
        real = self.forwarded(name)
        if real is not None:
            return real[0].read(real[1])
        data = bytearray(self.computed(name))  # a copy the tensor owns (and may write)
        return torch.frombuffer(data, dtype=torch.uint8).view(to_torch(info.dtype)) \
            .reshape(info.shape)

    def read_bytes(self, name: str):
        return self._file.read_bytes(self.info(name))

    def check_unchanged(self) -> None:
        self.source.check_unchanged()

    def close(self) -> None:
        self._cache.clear()

    def __enter__(self) -> "SourceView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the tensors ----------------------------------------------------------------------------
    def base(self, name: str):
        """Tensor ``name`` before its replacement (for the LoRA survival report)."""
        if name in self._replaced:
            return self._replaced[name][3]()
        return self.stored(name)

    def source_name(self, name: str) -> str | None:
        """The source tensor ``name`` is, byte for byte (a plain rename), else None."""
        if name in self._extra:
            return None
        t = self._targets[name]
        if t.op != COPY or len(t.sources) != 1 or t.fp8:
            return None
        return t.sources[0].name

    def forwarded(self, name: str):
        """A target stored unchanged (same bytes) in a source shard: (file, TensorInfo)."""
        if name in self._extra or name in self._replaced:
            return None
        t = self._targets[name]
        src = t.sources[0]
        kept = name.endswith(".weight") and name[: -len(".weight")] in self._kept
        if t.op != COPY or len(t.sources) != 1 or (t.fp8 and not kept) \
                or self.tensors[name].dtype != src.dtype:
            return None
        return self.source.file_of(src.name), self.source.info(src.name)

    def computed(self, name: str, cache: bool = True) -> memoryview:
        """The bytes of a computed target (held for the next reads, see ``CACHE_EXTRA``;
        ``cache=False``: built for this caller only)."""
        from h3quant.formats.container.dtypes import to_torch

        if name in self._extra:  # a kept layer's scale or marker: a few bytes
            return memoryview(self._extra[name][2])
        with self._lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
            if cache and self.tensors[name].nbytes > CACHE_EXTRA:  # replaces the big one held
                for old in [k for k, v in self._cache.items() if len(v) > CACHE_EXTRA]:
                    del self._cache[old]
            t = self._targets[name]
            want = to_torch(self.tensors[name].dtype)
            x = self._replaced[name][2]() if name in self._replaced else self.stored(name)
            if x.dtype != want or tuple(x.shape) != self.tensors[name].shape:
                raise AssertionError(f"{name}: computed {x.dtype} {list(x.shape)}, declared "
                                     f"{want} {list(self.tensors[name].shape)}")
            for src in t.sources:  # the source pages are not needed again
                for part in (src.name, src.scale):
                    if part is not None:
                        self.source.file_of(part).release_pages(self.source.info(part))
            data = memoryview(x.contiguous().reshape(-1).view(_u8()).numpy()).cast("B")
            if not cache:
                return data
            self._cache[name] = data
            while len(self._cache) > 1 and sum(
                    len(v) for k, v in self._cache.items() if k != name) > CACHE_EXTRA:
                self._cache.popitem(last=False)
            return data


def _u8():
    import torch

    return torch.uint8


def _nbytes(dtype: str, shape) -> int:
    from h3quant.formats.container.dtypes import itemsize

    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n


class _OwningView(SourceView):
    """A ``SourceView`` that closes its source checkpoint when it is closed."""

    def close(self) -> None:
        super().close()
        self.source.close()


def open_as_comfy(path, *, mmap: bool = True, naming: str = "auto",
                  quantized_target: bool = True):
    """Open ``path`` (a file, shard index or directory in any layout ``convert`` takes) as
    ComfyUI's single file: a plain ``Checkpoint`` when it is one (quantized or not), else a
    ``SourceView`` (official or diffusers shards, fp8 weights decoded: to F32 with
    ``quantized_target``, else rounded once to BF16). Closing it closes the files."""
    from h3quant.sources.open import open_source

    ckpt = open_source(path, mmap=mmap)  # a GGUF file: read in place (ComfyUI's names)
    try:
        _, mapping = adopt_mapping(ckpt, naming)
        if mapping.trivial:
            return ckpt
        return _OwningView(ckpt, mapping, quantized_target)
    except BaseException:
        ckpt.close()
        raise
