"""Group a checkpoint's tensors into layers and resolve each layer's quantization marker.

A layer ``L`` is any prefix with ``L.weight`` or ``L.comfy_quant``; its tensors are ``L.<suffix>``
for the suffixes quantization schemes use. The marker that counts is the header
``_quantization_metadata`` entry when the header has one (ComfyUI rebuilds the per-layer tensors
from it), else the ``L.comfy_quant`` tensor. Every broken or disagreeing marker becomes a finding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from h3quant.errors import MarkerError
from h3quant.findings import Finding
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.dtypes import QUANTIZED_WEIGHT_DTYPES
from h3quant.formats import registry
from h3quant.formats.markers import (
    MARKER_SUFFIX,
    QuantFormat,
    check_marker_object,
    effective_fields,
    parse_header_metadata,
    parse_marker_bytes,
)

LAYER_SUFFIXES = frozenset({
    "weight", "bias", "comfy_quant", "weight_scale", "weight_scale_2", "input_scale",
    "weight_s_rel", "weight_s_channel", "weight_codebook", "weight_correction",
    "weight_zero", "weight_zeros", "qweight", "qzeros", "scales",
}) | frozenset().union(*(s.storage.suffixes for s in registry.specs()))  # every format's tensor set


@dataclass
class Layer:
    name: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    fields: dict | None = None  # effective marker fields (None: a plain float layer)
    source: str | None = None  # "header", "tensor" or "header+tensor"

    @property
    def format(self) -> Any:
        """The marker's wire name, as a ``QuantFormat`` (None for a float layer)."""
        return QuantFormat(self.fields["format"]) if self.fields else None

    @property
    def weight(self) -> TensorInfo | None:
        return self.tensors.get("weight")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for k, t in self.tensors.items() if k != "comfy_quant")

    def tensor_name(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"


@dataclass
class LayerScan:
    layers: dict[str, Layer]
    others: list[str]  # tensors that belong to no layer
    header_layers: dict[str, dict] | None
    findings: list[Finding]

    @property
    def quantized(self) -> dict[str, Layer]:
        return {n: lay for n, lay in self.layers.items() if lay.fields is not None}


def group_tensors(tensors: dict[str, TensorInfo]) -> tuple[dict[str, Layer], list[str]]:
    prefixes = set()
    for name in tensors:
        if name.endswith(".weight"):
            prefixes.add(name[: -len(".weight")])
        elif name.endswith(MARKER_SUFFIX):
            prefixes.add(name[: -len(MARKER_SUFFIX)])
    layers: dict[str, Layer] = {}
    others: list[str] = []
    for name, info in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix in prefixes and suffix in LAYER_SUFFIXES:
            layers.setdefault(prefix, Layer(prefix)).tensors[suffix] = info
        else:
            others.append(name)
    return dict(sorted(layers.items())), others


def scan_layers(
    tensors: dict[str, TensorInfo],
    metadata: dict[str, str],
    read_bytes: Callable[[str], bytes],
    *,
    file: str | None = None,
) -> LayerScan:
    """Group ``tensors`` and resolve markers. ``read_bytes(name)`` reads one (tiny) marker tensor."""
    layers, others = group_tensors(tensors)
    found: list[Finding] = []

    def add(code: str, msg: str, tensor: str | None) -> None:
        found.append(Finding(code, msg, tensor=tensor, file=file))

    def add_error(exc: MarkerError, tensor: str | None) -> None:
        assert exc.code is not None  # the marker parsers give every error a finding code
        add(exc.code, exc.reason, tensor)

    header: dict[str, dict] | None = None
    try:
        header = parse_header_metadata(metadata)
    except MarkerError as exc:
        add_error(exc, None)
    header_fields: dict[str, dict] = {}
    for lname, raw in (header or {}).items():
        try:
            header_fields[lname] = effective_fields(check_marker_object(raw, "header metadata entry"))
        except MarkerError as exc:
            add_error(exc, lname)
        if lname not in layers:
            add("M112", "named in _quantization_metadata but the file has no such layer", lname)

    for layer in layers.values():
        tensor_fields = None
        marker = layer.tensors.get("comfy_quant")
        mname = layer.tensor_name("comfy_quant")
        if marker is not None:
            if marker.dtype != "U8" or len(marker.shape) != 1:
                add("M107", f"marker is {marker.dtype} {list(marker.shape)}, expected 1-D U8", mname)
            try:
                tensor_fields = effective_fields(parse_marker_bytes(bytes(read_bytes(mname))))
            except MarkerError as exc:
                add_error(exc, mname)
            if layer.weight is None:
                add("M108", "marker has no weight tensor beside it", mname)
        hdr = header_fields.get(layer.name)
        if hdr is not None and tensor_fields is not None:
            why = marker_disagreement(hdr, tensor_fields)
            if why:
                add("M110", why, mname)
            layer.fields, layer.source = hdr, "header+tensor"
        elif hdr is not None:
            layer.fields, layer.source = hdr, "header"
        elif tensor_fields is not None:
            layer.fields, layer.source = tensor_fields, "tensor"
            if header is not None:
                add("M113", "marker tensor present but the header metadata does not list the "
                    "layer", mname)
        weight = layer.weight
        broken_marker = marker is not None or layer.name in (header or {})
        if (layer.fields is None and not broken_marker and weight is not None
                and weight.dtype in QUANTIZED_WEIGHT_DTYPES and not _scaled_fp8(layer, tensors)):
            add("M109", f"weight is {weight.dtype} but the layer has no quantization marker",
                layer.tensor_name("weight"))
    if header is None and any(lay.source == "tensor" for lay in layers.values()):
        add("M113", "quantized layers carry marker tensors but the header has no "
            "_quantization_metadata (some loaders read only the header)", None)
    return LayerScan(layers, sorted(others), header, found)


_ACTED_ON = ("format", "convrot", "convrot_groupsize", "group_size", "full_precision_matrix_mult")


def _acted_on(fields: dict) -> dict:
    """The fields a loader acts on (extra fields such as orig_dtype are ignored by ComfyUI)."""
    return {k: fields[k] for k in _ACTED_ON if k in fields}


def marker_disagreement(header_fields: dict, tensor_fields: dict) -> str | None:
    """Why a layer's header metadata entry and its marker tensor disagree on a field a loader
    acts on (finding M110), or None. validate reports it; convert and verify refuse the file."""
    if _acted_on(header_fields) == _acted_on(tensor_fields):
        return None
    return (f"header metadata says {_short(header_fields)}, marker tensor says "
            f"{_short(tensor_fields)}; ComfyUI uses the header")


def _short(fields: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in _acted_on(fields).items()) + "}"


def scan_checkpoint(ckpt) -> LayerScan:
    """``scan_layers`` over an open ``Checkpoint``."""
    return scan_layers(ckpt.tensors, ckpt.metadata, ckpt.read_bytes, file=str(ckpt.path))


def _scaled_fp8(layer, tensors) -> bool:
    """ComfyUI's scaled fp8: an fp8 weight with a float scale companion and no marker (a layout
    of its own, decoded as code x scale; not a layer that lost its marker)."""
    from h3quant.formats.container.dtypes import FLOAT_DTYPES
    from h3quant.formats.check import FP8_SCALE_NAMES as FP8_SCALES

    w = layer.tensors.get("weight")
    names = [f"{layer.name}.{s}" for s in FP8_SCALES]
    return (w is not None and w.dtype in ("F8_E4M3", "F8_E5M2")
            and any(n in tensors and tensors[n].dtype in FLOAT_DTYPES for n in names))
