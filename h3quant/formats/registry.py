"""The one registry of on-disk layer formats: each format package's spec and codec, by name.

Every place that depends on a layer's format asks here instead of comparing format names:
``spec(name)`` gives any format ComfyUI or h3quant knows (its tensor set, marker defaults ...),
``codec_for(fields)`` the codec of a layer h3quant can read, encode and run (the plain codec
when there is no marker), ``target(name)`` a ``convert --to`` choice. Adding a format = its
package under ``h3quant.formats`` (exporting ``SPEC`` and ``CODEC``) and one line in
``_PACKAGES``. Formats ComfyUI knows that h3quant has no codec for are specs only
(``h3quant.formats.comfy_known``). Torch-free.
"""

from __future__ import annotations

import importlib

from h3quant.errors import UnsupportedError
from h3quant.formats.codec import Codec
from h3quant.formats.comfy_known import SPECS as _SPEC_ONLY
from h3quant.formats.spec import FormatSpec, RowRange, Target, VerifyLimits

# Registration order is the order of ``convert --to`` choices and of listings.
_PACKAGES = (
    "h3quant.formats.int8",
    "h3quant.formats.int8_kn",
    "h3quant.formats.w4a8",
    "h3quant.formats.fp8",
    "h3quant.formats.mxfp8",
    "h3quant.formats.nvfp4",
    "h3quant.formats.int4_convrot",
    "h3quant.formats.awq_w4a16",
    "h3quant.formats.svdquant_w4a4",
    "h3quant.formats.plain",
)

_SPECS: dict[str, FormatSpec] = {}
_CODECS: dict[str, Codec] = {}
_TARGETS: dict[str, Target] = {}


def register(spec: FormatSpec, codec: Codec | None = None) -> FormatSpec:
    """Add a format (and its convert targets); names must be new."""
    if not spec.name or spec.name in _SPECS:
        raise ValueError(f"format name {spec.name!r} is empty or already registered")
    if codec is not None and codec.spec is not spec:
        raise ValueError(f"the codec of {spec.name!r} is built on another spec")
    for t in spec.encoding.targets:
        if t.name in _TARGETS or t.codec != spec.name or codec is None:
            raise ValueError(f"target {t.name!r} is already registered, names another format "
                             "or has no codec")
    _SPECS[spec.name] = spec
    if codec is not None:
        _CODECS[spec.name] = codec
    for t in spec.encoding.targets:
        _TARGETS[t.name] = t
    return spec


for _pkg in _PACKAGES:
    _mod = importlib.import_module(_pkg)
    for _spec_, _codec_ in getattr(_mod, "FORMATS", ((_mod.SPEC, _mod.CODEC),)):
        register(_spec_, _codec_)  # a package may hold several formats (both fp8 variants)
for _spec in _SPEC_ONLY:
    register(_spec)

PLAIN = _CODECS["float"]


def _name(name) -> str:
    return str(getattr(name, "value", name))


def packages() -> tuple[str, ...]:
    """The format packages, in registration order (the import contracts name the same set)."""
    return _PACKAGES


# ---------------------------------------------------------------------------- specs
def specs() -> tuple[FormatSpec, ...]:
    """Every known format (the plain one included), in registration order."""
    return tuple(_SPECS.values())


def spec(name) -> FormatSpec | None:
    """The spec of a marker format name (None when no one knows it)."""
    return _SPECS.get(_name(name))


def known_names() -> frozenset[str]:
    """Every format name a marker may carry."""
    return frozenset(s.name for s in _SPECS.values() if s.quantized)


def comfy_names() -> frozenset[str]:
    """The format names ComfyUI itself knows (h3quant's NPU layout is not one of them)."""
    return frozenset(s.name for s in _SPECS.values() if s.quantized and s.comfy)


# ---------------------------------------------------------------------------- codecs
def codecs() -> tuple[Codec, ...]:
    return tuple(_CODECS.values())


def quantized_codecs() -> tuple[Codec, ...]:
    return tuple(c for c in _CODECS.values() if c.spec.quantized)


def supported_names() -> frozenset[str]:
    """Marker format names h3quant reads, converts and runs."""
    return frozenset(c.spec.name for c in quantized_codecs())


def get(name) -> Codec | None:
    """The codec of a marker format name (None when h3quant has none for it)."""
    codec = _CODECS.get(_name(name))
    return codec if codec is not None and codec.spec.quantized else None


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
    return codec.spec.reading.describe(fields) if codec is not None else str(fields.get("format"))


def kept_marker(code_dtype: str) -> dict | None:
    """The marker a source's fp8 codes of ``code_dtype`` (``F8_E4M3`` ...) are kept under, codes
    and one scale unchanged (a legacy scaled-fp8 layer written as a per-layer one); None when
    no format keeps such codes."""
    for s in _SPECS.values():
        marker = s.planning.kept_marker(code_dtype)
        if marker is not None:
            return marker
    return None


def marker_defaults(name) -> dict:
    s = spec(name)
    return dict(s.storage.marker_defaults) if s is not None and s.quantized else {}


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
    return codec.spec.reading.logical_k(cols, fields) if codec is not None else cols


def logical_shape(shape, fields: dict | None) -> tuple[int, int]:
    """Logical ``(N, K)`` of a stored 2-D weight under marker ``fields`` (a kn weight is [K, N])."""
    codec = get(fields["format"]) if fields else PLAIN
    return (codec or PLAIN).spec.reading.logical_shape(tuple(shape), fields)


def with_layout(codec: Codec, layout: str) -> Codec | None:
    """The codec storing ``codec``'s math in ``layout`` ("canonical" or "npu"); None if none."""
    base = codec.spec.canonical or codec.spec.name
    for c in _CODECS.values():
        if (c.spec.canonical or c.spec.name) == base and c.spec.layout == layout:
            return c
    return None


def layouts_of(codec: Codec) -> tuple[str, ...]:
    """The layouts ``codec``'s math can be written in."""
    base = codec.spec.canonical or codec.spec.name
    return tuple(c.spec.layout for c in _CODECS.values()
                 if (c.spec.canonical or c.spec.name) == base)


def verify_limits(name: str | None) -> VerifyLimits:
    """``verify`` limits of a format (a float layer uses the tightest of the formats)."""
    codec = get(name) if name else None
    if codec is not None and codec.spec.verify.limits is not None:
        return codec.spec.verify.limits
    return min((c.spec.verify.limits for c in quantized_codecs() if c.spec.verify.limits is not None),
               key=lambda v: v.rel_err)


def decoded_limits(name) -> VerifyLimits | None:
    """The ``verify`` limits of a format the runtime runs through its decode (fp8, mxfp8, ...);
    None for the int8-grid formats (int8, W4A8), whose limits ``verify`` options can set."""
    codec = get(name) if name else None
    if codec is None or not codec.spec.runtime.decodes:
        return None
    return codec.spec.verify.limits


def class_limits(bits: int) -> VerifyLimits:
    """``verify`` limits of a weight class (8: int8 formats, 4: 4-bit ones): the tightest of
    the formats with a codec whose weights have that many bits."""
    found = [c.spec.verify.limits for c in quantized_codecs()
             if c.spec.verify.weight_bits == bits and c.spec.verify.limits is not None]
    if not found:
        raise KeyError(f"no format with {bits}-bit weights has verify limits")
    return min(found, key=lambda v: v.rel_err)


def low_bit(names) -> bool:
    """Whether any of these formats stores weights in fewer than 8 bits (looser verify limits)."""
    return any((c := get(n)) is not None and c.spec.verify.weight_bits < 8 for n in names)


__all__ = ["PLAIN", "Codec", "FormatSpec", "RowRange", "Target", "VerifyLimits", "class_limits",
           "codec_for", "codecs", "comfy_names", "decoded_limits", "describe", "get", "kept_marker",
           "known_names", "layouts_of", "logical_k", "logical_shape", "low_bit", "marker_defaults",
           "packages", "quantized_codecs", "register", "spec", "specs", "supported_names", "target",
           "target_codec", "targets", "verify_limits", "with_layout"]
