"""Load the layers of chosen H3 blocks from a checkpoint, keeping quantized data exactly as stored.

FORMATS.md 3, 4, 5 and 8: a quantized layer keeps its int8 bytes and its
scales bit for bit (no re-quantization, no float round trip), its marker comes from the header
``_quantization_metadata`` or the ``.comfy_quant`` tensor (the header wins), marker and other
metadata-only keys never become tensors of the layer, and the stored row order ([q; k; v],
[gate; up]) is kept. Anything the runtime cannot run as stored is refused with a specific error:
an unsupported format (one without a codec), runtime quantization requested on a pre-quantized layer,
tensors that do not match the marker, a broken or disagreeing marker.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from h3quant.errors import (
    FindingError,
    FormatError,
    MarkerError,
    MarkerFindingError,
    UnsupportedError,
    VerifyError,
)
from h3quant.findings import Severity
from h3quant.formats import check as rules
from h3quant.formats import registry
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.formats.fp8.spec import E4M3
from h3quant.formats.layers import Layer, LayerScan, scan_checkpoint
from h3quant.formats.markers import QuantFormat
from h3quant.h3.topology import BLOCK_LINEARS

_BLOCK_RE = re.compile(r"^(.*?)blocks\.(\d+)\.")

LEGACY_FP8_FORMAT = E4M3.name  # the format a legacy scaled-fp8 layer loads as


@dataclass
class LoadedLayer:
    """One layer as stored: ``tensors`` are the file's tensors (marker excluded), unchanged.

    An ``int8_tensorwise_kn`` layer keeps its ``[K, N]`` weight as stored; its int8 grid is the
    ``[N, K]`` ``.t()`` view of it (no copy), so every consumer sees one int8 math.
    """

    name: str
    tensors: dict[str, torch.Tensor]
    fields: dict | None = None  # effective marker fields; None for a float layer
    source: str | None = None  # where the marker came from: header, tensor, header+tensor
    _grid: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def format(self) -> Any:
        """The marker's wire name, as a ``QuantFormat`` (None for a float layer)."""
        return QuantFormat(self.fields["format"]) if self.fields else None

    @property
    def codec(self) -> registry.Codec:
        """The layer's codec (the plain codec for a float layer)."""
        return registry.codec_for(self.fields, tensor=self.name)

    @property
    def is_quantized(self) -> bool:
        return self.fields is not None

    @property
    def weight(self) -> torch.Tensor:
        return self.tensors["weight"]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.tensors.get("bias")

    @property
    def is_int8(self) -> bool:
        """An int8 layer in either layout (canonical [N, K] or the NPU's [K, N]): its stored
        codes are the grid the int8 runtime multiplies."""
        codec = registry.get(self.format) if self.format else None
        return codec is not None and codec.spec.relayout.int8_codes

    @property
    def out_features(self) -> int:
        return int(self._logical_shape()[0])

    @property
    def in_features(self) -> int:
        return int(self._logical_shape()[1])

    def _logical_shape(self) -> tuple[int, int]:
        shape = tuple(self.weight.shape)
        if len(shape) != 2:
            return shape[0], shape[-1]
        return self.codec.spec.reading.logical_shape(shape, self.fields)

    @property
    def convrot(self) -> bool:
        """Whether the int8 grid is in the rotated basis (W4A8 always is)."""
        return self.codec.spec.reading.uses_convrot(self.fields)

    @property
    def convrot_groupsize(self) -> int:
        return int(self.fields.get("convrot_groupsize", 256)) if self.fields else 256

    @property
    def full_precision(self) -> bool:
        return bool(self.fields and self.fields.get("full_precision_matrix_mult", False))

    def int8_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [N, K], fp32 per-row scales [N]) the int8 runtime multiplies.

        int8: the stored codes (same storage) and the stored scales (a scalar is broadcast to N
        rows, exact). W4A8: decoded once to the int8 grid, scale = ``weight_s_channel``.
        """
        if not self.is_quantized:
            raise VerifyError("a float layer has no int8 grid", tensor=self.name)
        assert self.fields is not None  # is_quantized
        if self.decodes:
            raise VerifyError(f"{self.fields['format']} layers have no int8 grid (the runtime "
                              "runs them through their decode)", tensor=self.name)
        if self._grid is None:
            self._grid = self.codec.grid.int8_grid(self.tensors, self.fields)
        return self._grid

    def runtime_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes, fp32 scale) to build the runtime layer from: int8 layers pass the stored
        scale tensor in its stored shape ([N, 1], [N] or []); W4A8 the decoded grid and
        ``weight_s_channel``."""
        return self.codec.grid.runtime_weights(self.tensors, self.int8_grid())

    @property
    def decodes(self) -> bool:
        """A quantized layer the runtime runs through its codec's decode (fp8, mxfp8, ...)."""
        return self.is_quantized and bool(self.codec.spec.runtime.decodes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the original (un-rotated) basis: ``(q * s) @ H_g`` per block, the codec's
        decode (fp32, then ``dtype``) of a decoded format, or the float weight upcast."""
        if not self.is_quantized:
            return self.weight.to(dtype)
        if self.decodes:
            return self.codec.decoder.decode_weight(self.tensors, self.fields, torch.float32).to(dtype)
        q, s = self.int8_grid()
        w = q.to(torch.float32) * s[:, None]
        if self.convrot:
            from h3quant.convrot import rotate
            w = rotate(w, self.convrot_groupsize)  # H_g is its own inverse
        return w.to(dtype)


@dataclass
class LoadedBlock:
    index: int
    prefix: str  # "blocks.{i}"
    layers: dict[str, LoadedLayer]  # local name ("attn.qkv_proj", "norm1", ...) -> layer
    ignored: list[str] = field(default_factory=list)  # metadata-only keys under the prefix

    def param(self, local: str) -> torch.Tensor:
        """A float parameter such as ``norm1.weight`` or ``adaln_proj.linear.bias``."""
        lname, _, suffix = local.rpartition(".")
        layer = self.layers.get(lname)
        if layer is None or suffix not in layer.tensors:
            raise VerifyError("block tensor missing", tensor=f"{self.prefix}.{local}")
        return layer.tensors[suffix]

    def linear(self, local: str) -> LoadedLayer:
        layer = self.layers.get(local)
        if layer is None or "weight" not in layer.tensors:
            raise VerifyError("block linear missing", tensor=f"{self.prefix}.{local}.weight")
        return layer


def find_prefix(names) -> str:
    """The name prefix before ``blocks.{i}.`` (e.g. ``model.diffusion_model.``; usually "")."""
    found = {m.group(1) for n in names if (m := _BLOCK_RE.match(n))
             and not m.group(1).endswith("token_refiner.")}
    return min(found, key=len) if found else ""


def block_indices(ckpt: Checkpoint, prefix: str | None = None) -> list[int]:
    """Indices ``i`` of every ``{prefix}blocks.{i}.*`` tensor, sorted (token_refiner excluded)."""
    from h3quant.h3.topology import MAX_BLOCKS, block_index_beyond_limit

    prefix = find_prefix(ckpt.tensors) if prefix is None else prefix
    found = set()
    for name in ckpt.tensors:
        if (m := _BLOCK_RE.match(name)) and m.group(1) == prefix:
            if block_index_beyond_limit(name[len(prefix):]) is not None:  # validate's T106
                raise FindingError(f"block index beyond the limit: at most {MAX_BLOCKS} blocks "
                                   f"(0 .. {MAX_BLOCKS - 1})", path=ckpt.path, tensor=name,
                                   code="T106")
            found.add(int(m.group(2)))
    return sorted(found)


def _raise_marker_findings(scan: LayerScan, names: set[str], path,
                           scaled: frozenset[str] = frozenset()) -> None:
    """Raise the first ERROR marker finding that concerns one of ``names`` or the whole file
    (``scaled``: legacy scaled-fp8 weights, which need no marker)."""
    for f in scan.findings:
        if f.severity is not Severity.ERROR or (f.code == "M109" and f.tensor in scaled):
            continue
        owner = f.tensor.rpartition(".")[0] if f.tensor and f.tensor.endswith(".comfy_quant") \
            else f.tensor
        if f.tensor is None or owner in names or f.tensor in names:
            raise MarkerFindingError(f.message, path=path, tensor=f.tensor, code=f.code)


def check_quantized(layer: Layer, fields: dict, path) -> None:
    """Raise when the layer's tensors do not match what its marker says."""
    fmt = fields["format"]
    name = layer.name

    def bad(code: str, msg: str, suffix: str | None = None, cls=FormatError) -> NoReturn:
        raise cls(msg, path=path, tensor=layer.tensor_name(suffix) if suffix else name, code=code)

    codec = registry.get(fmt)
    if codec is None:
        bad("Q105", f"format {fmt!r} is not supported by the h3quant runtime (supported: "
            f"{', '.join(sorted(registry.supported_names()))})", cls=UnsupportedError)
    if fields.get("full_precision_matrix_mult") not in (True, False):
        bad("M114", "full_precision_matrix_mult must be a bool")
    extra = sorted(set(layer.tensors) - set(codec.spec.runtime.tensors) - {"bias", "comfy_quant"})
    if "weight_correction" in extra:
        bad("Q107", "weight_correction (asymmetric W4A8) is not loaded by ComfyUI; refusing to run "
            "a layer that depends on it", "weight_correction", cls=UnsupportedError)
    if extra:
        bad("Q106", f"tensors {extra} are not part of {fmt}; refusing to guess their meaning",
            extra[0], cls=UnsupportedError)
    for v in rules.layer_violations(fmt, fields, layer.tensors):
        bad(v.code, v.message, v.suffix)  # the rules validate and convert apply too


def load_layer(ckpt: Checkpoint, layer: Layer, *, quantize_on_load: bool = False) -> LoadedLayer:
    """One layer's tensors as stored. ``quantize_on_load`` (int8 ConvRot at load) applies to float
    linears only; on a pre-quantized layer it is refused (UnsupportedError)."""
    path = ckpt.path
    if layer.fields is not None:
        if quantize_on_load:
            raise UnsupportedError(
                f"runtime quantization was requested but the layer is already quantized "
                f"({layer.fields['format']}); re-quantizing would stack two quantizations",
                path=path, tensor=layer.name, code="Q105")
        check_quantized(layer, layer.fields, path)
        tensors = {s: ckpt.read(info.name) for s, info in layer.tensors.items()
                   if s != "comfy_quant"}
        codec = registry.codec_for(layer.fields, tensor=layer.name)
        for suffix in codec.spec.verify.deep_whole:  # the rules validate --deep and convert apply too
            v = codec.checks.data_violation(suffix, tensors[suffix]) if suffix in tensors else None
            if v is not None:
                raise FindingError(v.message, path=path, tensor=layer.tensor_name(v.suffix),
                                   code=v.code)
        return LoadedLayer(layer.name, tensors, dict(layer.fields), layer.source)
    legacy = legacy_scaled_fp8(ckpt, layer)
    if legacy is not None:
        return legacy
    weight = layer.tensors.get("weight")
    if weight is not None and weight.dtype in _FP8_WEIGHTS:
        tensors = _scaled_fp8(ckpt, layer)
    else:
        for s, info in layer.tensors.items():
            if info.dtype not in FLOAT_DTYPES:
                raise MarkerError(f"{s} is {info.dtype} but the layer has no quantization "
                                  "marker", path=path, tensor=info.name, code="M109")
        tensors = {s: ckpt.read(info.name) for s, info in layer.tensors.items()}
    loaded = LoadedLayer(layer.name, tensors)
    if quantize_on_load:
        loaded = _quantize_float(loaded, path)
    return loaded


def has_scaled_fp8_marker(ckpt: Checkpoint) -> bool:
    """The file carries ComfyUI's ``scaled_fp8`` marker and no ``_quantization_metadata`` (the
    only case in which ComfyUI's loader scales ``scale_weight`` layers; FORMATS.md 17.3)."""
    from h3quant.formats.fp8.spec import SCALED_FP8_MARKER
    from h3quant.formats.markers import HEADER_KEY

    root = find_prefix(ckpt.tensors)
    return f"{root}{SCALED_FP8_MARKER}" in ckpt.tensors and HEADER_KEY not in ckpt.metadata


def legacy_scaled_fp8(ckpt: Checkpoint, layer: Layer) -> LoadedLayer | None:
    """A legacy scaled-fp8 layer (e4m3 ``weight`` + one ``scale_weight``, optional
    ``scale_input``) of a file with the ``scaled_fp8`` marker, loaded as ComfyUI's loader
    renames it: a ``float8_e4m3fn`` layer with ``weight_scale`` (``input_scale`` unless 1.0)."""
    t = {**layer.tensors, **{sfx: ckpt.tensors[f"{layer.name}.{sfx}"]
                             for sfx in ("scale_weight", "scale_input")
                             if f"{layer.name}.{sfx}" in ckpt.tensors}}  # scanned as "others"
    w, s = t.get("weight"), t.get("scale_weight")
    if w is None or s is None or w.dtype != "F8_E4M3" or s.numel != 1 \
            or set(t) - {"weight", "scale_weight", "scale_input", "bias"} \
            or not has_scaled_fp8_marker(ckpt):
        return None
    tensors = {"weight": ckpt.read(w.name),
               "weight_scale": ckpt.read(s.name).to(torch.float32).reshape(())}
    if "bias" in t:
        tensors["bias"] = ckpt.read(t["bias"].name)
    if "scale_input" in t:
        si = ckpt.read(t["scale_input"].name).to(torch.float32)
        if si.numel() != 1 or float(si) != 1.0:
            tensors["input_scale"] = si.reshape(())
    return LoadedLayer(layer.name, tensors, {"format": LEGACY_FP8_FORMAT}, "scaled_fp8")


_FP8_WEIGHTS = ("F8_E4M3", "F8_E5M2")


def _scaled_fp8(ckpt: Checkpoint, layer: Layer) -> dict:
    """A ComfyUI scaled-fp8 layer (fp8 weight, float scale companion, no marker) decoded as
    ComfyUI decodes it: code x scale in fp32. The decoded weight must be finite: the rule
    (D106) ``validate --deep`` and convert apply to the same data."""
    from h3quant.h3.naming import FP8_SCALES, FP8_UNUSED

    path = ckpt.path
    scale = None
    out = {}
    for s in FP8_SCALES:  # the scale is a companion beside the layer, not one of its tensors
        info = ckpt.tensors.get(f"{layer.name}.{s}")
        if info is not None and info.dtype in FLOAT_DTYPES:
            scale = ckpt.read(info.name).float()
            break
    for s, info in layer.tensors.items():
        if s == "weight":
            continue
        if s in FP8_SCALES and info.dtype in FLOAT_DTYPES and scale is None:
            scale = ckpt.read(info.name).float()
        elif s in FP8_UNUSED:
            continue  # ComfyUI does not use it for the weight
        elif info.dtype in FLOAT_DTYPES:
            out[s] = ckpt.read(info.name)
        else:
            raise MarkerError(f"{s} is {info.dtype} but the layer has no quantization marker",
                              path=path, tensor=info.name, code="M109")
    codes = ckpt.read(layer.tensors["weight"].name)
    v = rules.fp8_weight_violation(codes, scale)
    if v is not None:
        raise FindingError(f"weight decoded from fp8: {v.message}", path=path,
                           tensor=layer.tensors["weight"].name, code=v.code)
    w = codes.float()
    if scale is not None:
        w = w * (scale.reshape(()) if scale.numel() == 1
                 else scale.reshape((-1,) + (1,) * (w.dim() - 1)))
    out["weight"] = w
    return out


def _quantize_float(layer: LoadedLayer, path) -> LoadedLayer:
    """int8 ConvRot (g=256, per row) of a float 2-D weight, the encoding of FORMATS.md 3."""
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.formats.int8.codec import int8_marker
    from h3quant.formats.markers import effective_fields
    w = layer.weight
    if w.dim() != 2:
        return layer  # norms and other 1-D parameters stay float
    if w.shape[1] % 256:
        raise UnsupportedError(f"cannot quantize on load: K={w.shape[1]} is not a multiple of 256",
                               path=path, tensor=layer.name, code="Q104")
    q, s = encode_int8(w, convrot=True, group_size=256, per_row=True)
    tensors = {"weight": q, "weight_scale": s}
    if layer.bias is not None:
        tensors["bias"] = layer.bias
    return LoadedLayer(layer.name, tensors, effective_fields(int8_marker(True, 256)), "load")


def load_blocks(
    source: str | os.PathLike | Checkpoint,
    blocks: list[int] | None = None,
    *,
    mmap: bool = True,
    quantize_on_load: bool = False,
    scan: LayerScan | None = None,
) -> list[LoadedBlock]:
    """The layers of ``blocks.{i}`` for each ``i`` in ``blocks`` (default: every block).

    ``source`` is a path (opened with ``mmap``; ``mmap=False`` reads with buffered I/O) or an open
    Checkpoint. Keys under the prefix that belong to no layer are listed in ``ignored``.
    """
    if not isinstance(source, (str, os.PathLike)):  # an open Checkpoint, or a source view
        return _load(source, blocks, quantize_on_load, scan)
    with Checkpoint(source, mmap=mmap) as ckpt:
        return _load(ckpt, blocks, quantize_on_load, scan)


def _load(ckpt: Checkpoint, blocks, quantize_on_load: bool, scan) -> list[LoadedBlock]:
    scan = scan if scan is not None else scan_checkpoint(ckpt)
    root = find_prefix(ckpt.tensors)
    have = block_indices(ckpt, root)
    wanted = have if blocks is None else list(blocks)
    missing = [i for i in wanted if i not in have]
    if missing:
        raise VerifyError(f"checkpoint has no blocks {missing} (it has {len(have)} blocks)",
                          path=ckpt.path)
    return [load_prefix(ckpt, scan, f"{root}blocks.{i}", i, quantize_on_load=quantize_on_load)
            for i in wanted]


def load_prefix(ckpt: Checkpoint, scan: LayerScan, prefix: str, index: int, *,
                quantize_on_load: bool = False) -> LoadedBlock:
    """Every layer under ``prefix.`` (a DiT block ``blocks.{i}`` or a refiner block
    ``token_refiner.blocks.{j}``) as a LoadedBlock."""
    lnames = {n for n in scan.layers if n.startswith(prefix + ".")}
    scaled = frozenset(f"{n}.weight" for n in lnames if f"{n}.scale_weight" in ckpt.tensors) \
        if has_scaled_fp8_marker(ckpt) else frozenset()
    _raise_marker_findings(scan, lnames | {n + ".weight" for n in lnames}, ckpt.path, scaled)
    layers = {n[len(prefix) + 1:]: load_layer(ckpt, scan.layers[n],
                                              quantize_on_load=quantize_on_load and
                                              n[len(prefix) + 1:] in BLOCK_LINEARS)
              for n in sorted(lnames)}
    ignored = [n for n in scan.others if n.startswith(prefix + ".")]
    return LoadedBlock(index, prefix, layers, ignored)
