"""Scheme registry: what tensors each quantization format stores (FORMATS.md 3 and 4).

A closed enum (``QuantFormat``) maps to one ``SchemeSpec``: the required and optional tensor
suffixes of a layer with their dtypes and shapes as functions of the logical ``[N, K]`` and the
marker fields, plus the format's divisibility constraints. ``check_layer`` turns mismatches into
findings (Q101-Q108); ``layer_report`` summarises a layer from its header entries alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from h3quant.convrot import is_valid_group_size
from h3quant.findings import Finding
from h3quant.formats.rules import checks as rules
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.formats.rules.markers import QuantFormat
from h3quant.formats.awq_w4a16 import spec as awq_spec
from h3quant.formats.int4_convrot import spec as int4_convrot_spec
from h3quant.formats.nvfp4 import spec as nvfp4_spec

# Allowed shapes given (N, K, fields); None = any shape.
ShapeRule = Callable[[int, int, dict], list[tuple[int, ...]]]


@dataclass(frozen=True)
class TensorSpec:
    suffix: str
    dtypes: tuple[str, ...]
    shapes: ShapeRule | None
    shape_text: str
    required: bool = True
    at_least: bool = False  # padded layouts: same rank, every dim >= the expected one

    def describe(self) -> str:
        return f"{'/'.join(self.dtypes)} {self.shape_text}"


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    format: QuantFormat | None
    supported: bool
    tensors: tuple[TensorSpec, ...]
    closed: bool  # tensors outside ``tensors`` are flagged (Q106)
    description: str

    @property
    def suffixes(self) -> frozenset[str]:
        return frozenset(t.suffix for t in self.tensors) | {"comfy_quant"}


_FLOATS = tuple(sorted(FLOAT_DTYPES))
_BIAS = TensorSpec("bias", _FLOATS, lambda n, k, f: [(n,)], "[N]", required=False)

def _scalar(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return [(), (1,)]


def _int8_scale(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return rules.int8_scale_shapes(n)


def _fp8_spec(fmt: QuantFormat, dtype: str, kind: str) -> SchemeSpec:
    return SchemeSpec(
        fmt.value, fmt, False,
        (
            TensorSpec("weight", (dtype,), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", ("F32",), _int8_scale, "[] (or per row)"),
            TensorSpec("input_scale", ("F32",), _scalar, "[]", required=False),
            _BIAS,
        ),
        True, f"fp8 {kind} weight with an fp32 tensor scale",
    )


SCHEMES: dict[QuantFormat, SchemeSpec] = {
    QuantFormat.INT8_TENSORWISE: SchemeSpec(
        "int8_tensorwise", QuantFormat.INT8_TENSORWISE, True,
        (
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", rules.SCALE_DTYPES, _int8_scale,
                       "[N, 1] (per row), [] (tensorwise) or [N]"),
            _BIAS,
            TensorSpec("input_scale", ("F32",), _scalar, "[]", required=False),
        ),
        True, "int8 weight with per-row (or tensorwise) fp32 scale, optional ConvRot",
    ),
    QuantFormat.INT8_TENSORWISE_KN: SchemeSpec(
        "int8_tensorwise_kn", QuantFormat.INT8_TENSORWISE_KN, True,
        (
            TensorSpec("weight", ("I8",), lambda n, k, f: [(k, n)], "[K, N]"),
            TensorSpec("weight_scale", ("F32",), lambda n, k, f: [(n,)], "[N]"),
            _BIAS,
        ),
        True, "int8_tensorwise pre-transposed for the NPU: weight [K, N], scale [N] (FORMATS.md 9)",
    ),
    QuantFormat.ASYM_W4A8_INT8: SchemeSpec(
        "asym_w4a8_int8", QuantFormat.ASYM_W4A8_INT8, True,
        (
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k // 2)], "[N, K/2]"),
            TensorSpec("weight_s_rel", ("F8_E4M3", "U8"),
                       lambda n, k, f: [(n, k // f["group_size"])], "[N, K/G]"),
            TensorSpec("weight_s_channel", rules.SCALE_DTYPES,
                       lambda n, k, f: rules.w4a8_channel_shapes(n), "[N]"),
            TensorSpec("weight_codebook", ("F32",), lambda n, k, f: [(16,)], "[16]",
                       required=False),
            TensorSpec("weight_correction", _FLOATS, None, "[K/G, N]", required=False),
            _BIAS,
        ),
        True, "4-bit codes (two per byte) + e4m3 group scales + fp32 row scales, ConvRot always on",
    ),
    QuantFormat.FLOAT8_E4M3FN: _fp8_spec(QuantFormat.FLOAT8_E4M3FN, "F8_E4M3", "e4m3"),
    QuantFormat.FLOAT8_E5M2: _fp8_spec(QuantFormat.FLOAT8_E5M2, "F8_E5M2", "e5m2"),
    QuantFormat.MXFP8: SchemeSpec(
        "mxfp8", QuantFormat.MXFP8, False,
        (
            TensorSpec("weight", ("F8_E4M3",), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", ("U8", "F8_E8M0"), lambda n, k, f: [(n, -(-k // 32))],
                       "[N, K/32] (may be padded)", at_least=True),
            TensorSpec("input_scale", ("F32",), _scalar, "[]", required=False),
            _BIAS,
        ),
        True, "fp8 e4m3 weight + e8m0 block scales (32)",
    ),
}

# Formats whose package declares its tensor set and header rules itself (spec.TENSORS, rules).
_SPEC_RULES = {QuantFormat.NVFP4: nvfp4_spec, QuantFormat.CONVROT_W4A4: int4_convrot_spec,
               QuantFormat.AWQ_W4A16: awq_spec}


def _from_package(fmt: QuantFormat, spec) -> SchemeSpec:
    tensors = tuple(TensorSpec(sfx, dtypes, None, words, required=req)
                    for sfx, dtypes, words, req in spec.TENSORS)
    return SchemeSpec(spec.NAME, fmt, True, tensors, True, spec.DESCRIPTION)


SCHEMES.update({fmt: _from_package(fmt, spec) for fmt, spec in _SPEC_RULES.items()})

PLAIN_FLOAT = SchemeSpec(
    "float", None, True,
    (TensorSpec("weight", _FLOATS, None, "any"), _BIAS), False,
    "unquantized floating-point layer",
)


def scheme_for(layer) -> SchemeSpec:
    """The layer's scheme: its marker's format, or the plain-float pseudo-scheme."""
    fmt = layer.format
    return PLAIN_FLOAT if fmt is None else SCHEMES[fmt]


# --------------------------------------------------------------------------- geometry


def logical_shape(layer) -> tuple[int | None, int | None]:
    """The logical ``(N, K)`` of a layer from its header entries (None where it cannot be told)."""
    w = layer.weight
    if w is None or len(w.shape) != 2:
        return (w.shape[0] if w is not None and len(w.shape) == 1 else None), None
    n, cols = w.shape
    fmt = layer.format
    if fmt is QuantFormat.ASYM_W4A8_INT8:
        s_rel = layer.tensors.get("weight_s_rel")
        g = layer.fields.get("group_size")
        if s_rel is not None and len(s_rel.shape) == 2 and isinstance(g, int) and g > 0:
            return n, s_rel.shape[1] * g
        return n, 2 * cols
    if fmt in _SPEC_RULES:
        return _SPEC_RULES[fmt].logical_shape((n, cols), layer.fields)
    if fmt is QuantFormat.INT8_TENSORWISE_KN:
        return cols, n  # stored [K, N]
    return n, cols


def _shape_ok(shape: tuple[int, ...], allowed: list[tuple[int, ...]], at_least: bool) -> bool:
    if at_least:
        return any(len(shape) == len(a) and all(s >= e for s, e in zip(shape, a)) for a in allowed)
    return tuple(shape) in allowed


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------- checks


def check_layer(layer) -> list[Finding]:
    """Scheme findings (Q101-Q108) for one layer, from header entries only."""
    spec = scheme_for(layer)
    if spec is PLAIN_FLOAT:
        return []
    out: list[Finding] = []
    fields = layer.fields

    def add(code: str, msg: str, suffix: str = "weight") -> None:
        info = layer.tensors.get(suffix) or layer.weight
        out.append(Finding(code, msg, tensor=layer.tensor_name(suffix),
                           file=str(info.file) if info is not None else None))

    if not spec.supported:
        add("Q105", f"format {spec.name} is known to ComfyUI but h3quant cannot convert or run it; "
            "only its tensor set is checked")
    if layer.weight is None:
        add("Q101", f"layer has a {spec.name} marker but no weight tensor")
        return out
    if spec.format in _SPEC_RULES:  # the package's own rules, then tensors it does not define
        for v in _SPEC_RULES[spec.format].rules(fields or {}, layer.tensors):
            add(v.code, v.message, v.suffix)
        for suffix in sorted(set(layer.tensors) - spec.suffixes):
            add("Q106", f"{spec.name} defines no '{suffix}' tensor (expected only "
                f"{', '.join(sorted(spec.suffixes - {'comfy_quant'}))}); loaders ignore or reject it",
                suffix)
        return out
    n, k = logical_shape(layer)
    if len(layer.weight.shape) != 2 and spec.tensors[0].shapes is not None:
        add("Q103", f"weight is {_fmt_shape(layer.weight.shape)}, expected a 2-D "
            f"{spec.tensors[0].describe()}")
    if spec.format is QuantFormat.ASYM_W4A8_INT8:
        _w4a8_geometry(layer, n, k, add)
    if spec.format is QuantFormat.INT8_TENSORWISE_KN:
        from h3quant.formats.codecs.int8_kn.tensors import check_kn

        out.extend(check_kn(layer, n, k, file=str(layer.weight.file)))
    for ts in spec.tensors:
        info = layer.tensors.get(ts.suffix)
        if info is None:
            if ts.required:
                add("Q101", f"{spec.name} layer lacks {layer.tensor_name(ts.suffix)} "
                    f"(expected {ts.describe()})", ts.suffix)
            continue
        if info.dtype not in ts.dtypes:
            add("Q102", f"is {info.dtype}, expected {ts.describe()} for {spec.name}", ts.suffix)
        if ts.shapes is None or n is None or k is None or _skip_shape(spec, ts, layer, n, k):
            continue
        allowed = ts.shapes(n, k, fields)
        if not _shape_ok(info.shape, allowed, ts.at_least):
            want = " or ".join(_fmt_shape(a) for a in allowed)
            add("Q103", f"is {_fmt_shape(info.shape)}, expected {ts.shape_text} = {want} "
                f"for N={n}, K={k}", ts.suffix)
    if spec.closed:
        for suffix in sorted(set(layer.tensors) - spec.suffixes):
            known = ", ".join(sorted(spec.suffixes - {"comfy_quant"}))
            add("Q106", f"{spec.name} defines no '{suffix}' tensor (expected only {known}); "
                "loaders ignore or reject it", suffix)
    if "weight_correction" in layer.tensors and spec.format is QuantFormat.ASYM_W4A8_INT8:
        add("Q107", "asymmetric correction tensor present; ComfyUI does not load it, so the layer "
            "runs as the symmetric variant (expected no weight_correction)", "weight_correction")
    if k is not None:
        _constraints(spec, layer, k, add)
    if spec.supported and spec.format is not None:  # rules across fields and tensors
        seen = {(f.code, f.tensor) for f in out}
        for v in rules.combination_violations(spec.name, layer.fields or {}, layer.tensors):
            if (v.code, layer.tensor_name(v.suffix)) not in seen:
                add(v.code, v.message, v.suffix)
    return out


def _skip_shape(spec: SchemeSpec, ts: TensorSpec, layer, n: int, k: int) -> bool:
    """W4A8 weight width and s_rel columns are judged by ``_w4a8_geometry`` instead; the kn
    scale against the weight by ``kn_rules.check_kn`` (Q109)."""
    if spec.format is QuantFormat.INT8_TENSORWISE_KN:
        return ts.suffix == "weight_scale"
    if spec.format is not QuantFormat.ASYM_W4A8_INT8:
        return False
    g = layer.fields.get("group_size")
    if not isinstance(g, int) or g <= 0:
        return ts.suffix == "weight_s_rel"
    return ts.suffix == "weight"


def _w4a8_geometry(layer, n, k, add) -> None:
    """Packed width vs the K implied by the s_rel grid (4-bit: K/2 bytes; 6-bit: 3K/4)."""
    w = layer.weight
    if n is None or k is None or len(w.shape) != 2 or w.dtype not in ("I8", "U8"):
        return
    cols = w.shape[1]
    if 2 * cols == k:
        return
    g = layer.fields.get("group_size")
    s_rel = layer.tensors.get("weight_s_rel")
    src = (f"weight_s_rel {_fmt_shape(s_rel.shape)} x group_size {g}"
           if s_rel is not None and len(s_rel.shape) == 2 else "the packed width")
    if 4 * cols == 3 * k:
        add("Q105", f"packed width {cols} = 3K/4 for K={k} ({src}): the 6-bit W4A8 variant, which "
            "h3quant cannot convert or run (expected [N, K/2])")
    else:
        add("Q103", f"is {_fmt_shape(w.shape)}: packed width {cols} does not match K={k} from "
            f"{src}; expected I8 [N, K/2] = {_fmt_shape((n, k // 2))} (two 4-bit codes per byte)")


def _constraints(spec: SchemeSpec, layer, k: int, add) -> None:
    f = layer.fields
    convrot = f.get("convrot", False) or spec.format is QuantFormat.ASYM_W4A8_INT8
    if spec.format not in (QuantFormat.INT8_TENSORWISE, QuantFormat.INT8_TENSORWISE_KN,
                           QuantFormat.ASYM_W4A8_INT8):
        return
    if convrot:
        g = f.get("convrot_groupsize", 256)
        if not is_valid_group_size(g):
            add("Q104", f"convrot_groupsize {g!r} is not a power of 4 (4, 16, 64, 256, 1024); "
                "ConvRot's Hadamard exists only for those sizes")
        elif k % g:
            add("Q104", f"K={k} is not divisible by convrot_groupsize {g}; every rotation block "
                "must be whole")
    if spec.format is QuantFormat.ASYM_W4A8_INT8:
        g = f.get("group_size", 16)
        if not isinstance(g, int) or g < 4 or (16 % g and g % 16):
            add("Q108", f"group_size {g!r} is illegal: it must be >= 4 and divide 16 or be a "
                "multiple of 16")
        else:
            bad = [d for d in (16, g) if k % d]
            if bad:
                divisors = " and ".join(map(str, sorted(set(bad))))
                add("Q108", f"K={k} is not divisible by {divisors}; "
                    f"W4A8 needs K % 16 == 0 and K % group_size ({g}) == 0")


# --------------------------------------------------------------------------- reports


@dataclass
class LayerReport:
    name: str
    format: str  # wire format name, or the weight dtype for a float layer
    N: int | None
    K: int | None
    dtypes: dict[str, str]
    nbytes: int  # every tensor but the marker
    bits_per_weight: float | None
    source: str | None = None  # where the marker came from
    quantized: bool = False
    params: int = 0  # logical weight elements (N*K, or the weight's numel)
    weight_bytes: int = 0  # bytes counted in bits_per_weight
    layout: str | None = None  # quantized: "canonical" or "npu" (int8_tensorwise_kn, [K, N])
    nz: bool | None = None  # npu layout: FRACTAL_NZ-eligible (K % 16 == 0 and N % 32 == 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("quantized", "params", "weight_bytes"):
            d.pop(k)
        d["bytes"] = d.pop("nbytes")
        d["layout"], d["nz"] = d.pop("layout"), d.pop("nz")  # last, after bytes
        return d


def layer_report(layer) -> LayerReport:
    """Header-only summary: bpw = 8 * bytes of weight and scales (not bias/marker) / (N*K)."""
    n, k = logical_shape(layer)
    w = layer.weight
    quantized = layer.fields is not None
    if quantized:
        fmt = layer.fields["format"]
    else:
        fmt = w.dtype if w is not None else "?"
    if n is not None and k is not None:
        params = n * k
    else:
        params = w.numel if w is not None else 0
    wbytes = sum(t.nbytes for s, t in layer.tensors.items() if s not in ("bias", "comfy_quant"))
    bpw = round(8 * wbytes / params, 4) if params else None
    nz = None
    if layer.format is QuantFormat.INT8_TENSORWISE_KN and n is not None and k is not None:
        from h3quant.formats.codecs.int8_kn.tensors import nz_eligible  # imports torch: only for kn layers

        nz = nz_eligible(n, k)
    return LayerReport(
        name=layer.name, format=fmt, N=n, K=k,
        dtypes={s: t.dtype for s, t in sorted(layer.tensors.items())},
        nbytes=layer.nbytes, bits_per_weight=bpw, source=layer.source,
        quantized=quantized, params=params, weight_bytes=wbytes,
        layout=_layout(layer.format) if quantized else None,
        nz=nz,
    )


def _layout(fmt: QuantFormat | None) -> str | None:
    return "npu" if fmt is QuantFormat.INT8_TENSORWISE_KN else "canonical"
