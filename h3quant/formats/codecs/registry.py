"""The registry of on-disk layer formats: one codec object per format, looked up by name.

Every place that depends on a layer's format asks here instead of comparing format names:
``codec_for(fields)`` gives the codec of a layer from its effective marker fields (the plain
codec when there is no marker), ``target(name)`` a ``convert --to`` choice. A new format is one
module under ``h3quant.formats.codecs`` defining ``CODEC`` and one line in ``_MODULES``.
Formats ComfyUI knows but h3quant has no codec for have their tensor sets checked by
``h3quant.formats.rules.schemes``.
"""

from __future__ import annotations

import importlib

from h3quant.errors import UnsupportedError
from h3quant.formats.codecs.base import Codec, RowRange, Target, VerifyLimits

# Registration order is the order of ``convert --to`` choices and of listings.
_MODULES = (
    "h3quant.formats.codecs.int8.codec",
    "h3quant.formats.codecs.int8_kn.codec",
    "h3quant.formats.codecs.w4a8.codec",
    "h3quant.formats.nvfp4.codec",
    "h3quant.formats.int4_convrot.codec",
    "h3quant.formats.awq_w4a16.codec",
    "h3quant.formats.codecs.plain",
)

_CODECS: dict[str, Codec] = {}
_TARGETS: dict[str, Target] = {}


def register(codec: Codec) -> Codec:
    """Add ``codec`` (and its convert targets); names must be new."""
    if not codec.name or codec.name in _CODECS:
        raise ValueError(f"codec name {codec.name!r} is empty or already registered")
    for t in codec.targets:
        if t.name in _TARGETS or t.codec != codec.name:
            raise ValueError(f"target {t.name!r} is already registered or names another codec")
    _CODECS[codec.name] = codec
    for t in codec.targets:
        _TARGETS[t.name] = t
    return codec


for _mod in _MODULES:
    register(importlib.import_module(_mod).CODEC)

PLAIN = _CODECS["float"]


def codecs() -> tuple[Codec, ...]:
    return tuple(_CODECS.values())


def quantized_codecs() -> tuple[Codec, ...]:
    return tuple(c for c in _CODECS.values() if c.quantized)


def supported_names() -> frozenset[str]:
    """Marker format names h3quant reads, converts and runs."""
    return frozenset(c.name for c in quantized_codecs())


def get(name: str) -> Codec | None:
    """The codec of a marker format name (None when h3quant has none for it)."""
    codec = _CODECS.get(str(getattr(name, "value", name)))
    return codec if codec is not None and codec.quantized else None


def codec_for(fields: dict | None, *, tensor: str | None = None) -> Codec:
    """The codec of a layer with effective marker ``fields`` (the plain codec for None).

    Raises UnsupportedError for a format ComfyUI knows that h3quant has no codec for."""
    if fields is None:
        return PLAIN
    codec = get(fields["format"])
    if codec is None:
        raise UnsupportedError(
            f"layer is stored as {fields['format']}, which h3quant cannot read (supported: "
            f"{', '.join(sorted(supported_names()))}, float)", tensor=tensor, code="Q105")
    return codec


def describe(fields: dict | None, dtype: str | None = None) -> str:
    """Short text for a layer's storage: ``BF16``, ``int8_tensorwise convrot g=256`` ..."""
    if not fields:
        return dtype or "float"
    codec = get(fields.get("format"))
    return codec.describe(fields) if codec is not None else str(fields.get("format"))


def marker_defaults(name: str) -> dict:
    codec = get(name)
    return dict(codec.marker_defaults) if codec is not None else {}


def targets() -> dict[str, Target]:
    """``convert --to`` choices, in registration order."""
    return dict(_TARGETS)


def target(name: str) -> Target:
    return _TARGETS[name]


def target_codec(name: str) -> Codec:
    return _CODECS[_TARGETS[name].codec]


def logical_k(cols: int, fields: dict | None) -> int:
    """Logical input width of a stored weight with ``cols`` columns under marker ``fields``."""
    codec = get(fields["format"]) if fields else PLAIN
    return codec.logical_k(cols, fields) if codec is not None else cols


def logical_shape(shape, fields: dict | None) -> tuple[int, int]:
    """Logical ``(N, K)`` of a stored 2-D weight under marker ``fields`` (a kn weight is [K, N])."""
    codec = get(fields["format"]) if fields else PLAIN
    return (codec or PLAIN).logical_shape(tuple(shape), fields)


def with_layout(codec: Codec, layout: str) -> Codec | None:
    """The codec storing ``codec``'s math in ``layout`` ("canonical" or "npu"); None if none."""
    base = codec.canonical or codec.name
    for c in _CODECS.values():
        if (c.canonical or c.name) == base and c.layout == layout:
            return c
    return None


def layouts_of(codec: Codec) -> tuple[str, ...]:
    """The layouts ``codec``'s math can be written in."""
    base = codec.canonical or codec.name
    return tuple(c.layout for c in _CODECS.values() if (c.canonical or c.name) == base)


def verify_limits(name: str | None) -> VerifyLimits:
    """``verify`` limits of a format (a float layer uses int8's: the tightest)."""
    codec = get(name) if name else None
    return (codec or _CODECS["int8_tensorwise"]).verify


def low_bit(names) -> bool:
    """Whether any of these formats stores weights in fewer than 8 bits (looser verify limits)."""
    return any((c := get(n)) is not None and c.weight_bits < 8 for n in names)


__all__ = ["PLAIN", "Codec", "RowRange", "Target", "VerifyLimits", "codec_for", "codecs", "describe",
           "get", "layouts_of", "logical_k", "logical_shape", "low_bit", "marker_defaults",
           "quantized_codecs", "register", "supported_names", "with_layout",
           "target", "target_codec", "targets", "verify_limits"]
