"""Per-layer quantization markers (``L.comfy_quant``) and the header ``_quantization_metadata``.

FORMATS.md 2. A marker is a 1-D U8 tensor holding UTF-8 JSON (an object with a ``format``).
Optional fields may also sit under ``params``; a top-level field wins. Unknown extra fields are
accepted. Header metadata, when present, wins over the per-layer tensors in ComfyUI.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING

from h3quant.errors import MarkerError
from h3quant.formats.container import jsonsafe
from h3quant.formats import registry

if TYPE_CHECKING:
    import torch

MARKER_SUFFIX = ".comfy_quant"
HEADER_KEY = "_quantization_metadata"
HEADER_VERSION = "1.0"


# Every format name a marker may carry, as an enum of wire names (ComfyUI's formats and
# h3quant's NPU layout, FORMATS.md 9), built from the registry: one member per format package
# or spec-only entry, named after the wire name (``QuantFormat.INT8_TENSORWISE``).
QuantFormat = Enum("QuantFormat",  # type: ignore[misc]
                   {s.name.upper(): s.name for s in registry.specs() if s.quantized}, type=str)

# The formats h3quant reads, converts and runs: those with a codec in the registry.
SUPPORTED_FORMATS = frozenset(QuantFormat(n) for n in registry.supported_names())

# The format names ComfyUI itself knows (FORMATS.md 2); int8_tensorwise_kn is not one of them.
COMFY_FORMATS = frozenset(QuantFormat(n) for n in registry.comfy_names())


def known_format_names() -> frozenset[str]:
    """Every format name a marker may carry: ComfyUI's and any registered format's."""
    return registry.known_names()


_FIELD_TYPES = {
    "convrot": bool,
    "convrot_groupsize": int,
    "group_size": int,
    "full_precision_matrix_mult": bool,
}


def check_marker_object(obj: object, where: str) -> dict:
    """``obj`` when it is a marker object naming a known format; else MarkerError (coded)."""
    if not isinstance(obj, dict):
        raise MarkerError(f"{where} JSON is a {type(obj).__name__}, expected an object", code="M104")
    if "format" not in obj:
        raise MarkerError(f"{where} has no 'format' field", code="M105")
    fmt = obj["format"]
    known_names = known_format_names()
    if not isinstance(fmt, str) or fmt not in known_names:
        known = ", ".join(sorted(known_names))
        raise MarkerError(f"{where} names unknown format {fmt!r} (known: {known})", code="M106")
    return obj


def parse_marker_bytes(raw: bytes) -> dict:
    """Decode a marker's bytes to its raw JSON object; MarkerError (with a code) when broken."""
    if len(raw) == 0:
        raise MarkerError("marker is zero-length", code="M101")
    if b"\x00" in raw:
        what = "all NUL bytes" if raw.count(0) == len(raw) else "NUL bytes"
        raise MarkerError(f"marker holds {what} ({len(raw)} bytes)", code="M102")
    try:
        obj = jsonsafe.loads(raw)
    except ValueError as exc:
        raise MarkerError(f"marker is not UTF-8 JSON ({exc})", code="M103") from None
    return check_marker_object(obj, "marker")


def effective_fields(obj: dict) -> dict:
    """The fields a loader acts on: ``params`` merged under top-level fields, defaults filled."""
    merged: dict = {}
    params = obj.get("params")
    if isinstance(params, dict):
        merged.update(params)
    merged.update({k: v for k, v in obj.items() if k != "params"})
    for key, value in registry.marker_defaults(merged["format"]).items():
        merged.setdefault(key, value)
    for key, typ in _FIELD_TYPES.items():
        if key in merged:
            value = merged[key]
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise MarkerError(f"field {key!r} is {value!r}, expected {typ.__name__}", code="M114")
    merged.setdefault("full_precision_matrix_mult", False)
    return merged


def marker_bytes(fields: dict) -> bytes:
    """Canonical marker bytes: Python's default ``json.dumps`` separators, as ComfyUI writes."""
    return json.dumps(fields).encode("utf-8")


def marker_tensor(fields: dict) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(marker_bytes(fields)), dtype=torch.uint8).clone()


def parse_header_metadata(metadata: dict[str, str]) -> dict[str, dict] | None:
    """``{layer: raw fields}`` from ``__metadata__[_quantization_metadata]``, or None if absent."""
    raw = metadata.get(HEADER_KEY)
    if raw is None:
        return None
    try:
        obj = jsonsafe.loads(raw)
    except ValueError as exc:
        raise MarkerError(f"{HEADER_KEY} is not JSON ({exc})", code="M111") from None
    layers = obj.get("layers") if isinstance(obj, dict) else None
    if not isinstance(layers, dict):
        raise MarkerError(f"{HEADER_KEY} has no 'layers' object", code="M111")
    return layers


def header_metadata_value(layers: dict[str, dict]) -> str:
    """The ``_quantization_metadata`` string for these layers (sorted, deterministic)."""
    body = {"format_version": HEADER_VERSION, "layers": {k: layers[k] for k in sorted(layers)}}
    return json.dumps(body)


# header metadata keys something reads: safetensors' own, ComfyUI's marker table, h3quant's
# provenance (``h3quant.*``)
READ_METADATA = frozenset({"format", HEADER_KEY})


def unread_metadata(metadata: dict[str, str]) -> list[str]:
    """The header metadata keys neither ComfyUI's loader nor h3quant reads (kept, ignored)."""
    return sorted(k for k in metadata if k not in READ_METADATA and not k.startswith("h3quant."))


def layer_of_marker(tensor_name: str) -> str:
    return tensor_name[: -len(MARKER_SUFFIX)]
