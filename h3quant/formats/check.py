"""One rule set for every format, used by ``validate``, ``convert`` and ``verify`` alike, so the
three commands give the same verdict on the same file.

The rules are the formats' own (their ``FormatSpec``: tensor set as data, plus the few header
rules a format adds); this module runs them for a layer found through the registry. Tensor
rules (header only: dtypes, shapes, marker field combinations; ``layer_violations`` and the
finding-level ``check_layer``) and data rules (finite positive scales, finite float weights).
The verdicts on the cases the commands could disagree on are listed in docs/verify.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from h3quant.convrot.groups import is_valid_group_size
from h3quant.findings import Finding
from h3quant.formats import registry
from h3quant.formats.spec import SCALE_DTYPES, FormatSpec, Violation

if TYPE_CHECKING:
    import torch

__all__ = ["PLAIN_FLOAT", "SCALE_DTYPES", "SCHEMES", "Violation", "check_layer",
           "combination_violations", "fit_error", "layer_violations", "logical_shape",
           "scale_violations", "spec_for", "weight_violation"]


def _supported(fmt) -> FormatSpec | None:
    codec = registry.get(fmt)
    return codec.spec if codec is not None else None


def combination_violations(fmt: str, fields: dict, tensors: dict) -> list[Violation]:
    """Rules across a layer's marker fields and tensors (beyond one tensor's dtype/shape)."""
    spec = _supported(fmt)
    return spec.rules.combination_violations(fields, tensors) if spec is not None else []


def layer_violations(fmt: str, fields: dict, tensors: dict) -> list[Violation]:
    """Every tensor rule of a layer of a format h3quant converts. ``tensors`` maps suffix -> an
    object with ``dtype`` (safetensors name) and ``shape``."""
    spec = _supported(fmt)
    return spec.rules.layer_violations(fields, tensors) if spec is not None else []


def fit_error(fmt: str, layer, fields: dict) -> str | None:
    """The first tensor-rule violation of ``layer`` as one line (what convert refuses), or None."""
    spec = _supported(fmt)
    return spec.rules.fit_error(layer, fields) if spec is not None else None


# ---------------------------------------------------------------------------- scheme findings
PLAIN_FLOAT: FormatSpec = registry.PLAIN.spec
SCHEMES: dict[str, FormatSpec] = {s.name: s for s in registry.specs() if s.quantized}


def spec_for(layer) -> FormatSpec:
    """The layer's format spec: its marker's format, or the plain float one."""
    fmt = layer.fields["format"] if layer.fields else None
    return PLAIN_FLOAT if fmt is None else SCHEMES[fmt]


def logical_shape(layer) -> tuple[int | None, int | None]:
    """The logical ``(N, K)`` of a layer from its header entries (None where it cannot be told)."""
    w = layer.weight
    if w is None or len(w.shape) != 2:
        return (w.shape[0] if w is not None and len(w.shape) == 1 else None), None
    return spec_for(layer).reading.header_nk(layer)


def _shape_ok(shape: tuple[int, ...], allowed: list[tuple[int, ...]], at_least: bool) -> bool:
    if at_least:
        return any(len(shape) == len(a) and all(s >= e for s, e in zip(shape, a)) for a in allowed)
    return tuple(shape) in allowed


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_layer(layer) -> list[Finding]:
    """Scheme findings (Q101-Q109) for one layer, from header entries only."""
    spec = spec_for(layer)
    if not spec.quantized:
        return []
    out: list[Finding] = []
    fields = layer.fields
    supported = registry.get(spec.name) is not None

    def add(code: str, msg: str, suffix: str = "weight") -> None:
        info = layer.tensors.get(suffix) or layer.weight
        out.append(Finding(code, msg, tensor=layer.tensor_name(suffix),
                           file=str(info.file) if info is not None else None))

    if not supported:
        add("Q105", f"format {spec.name} is known to ComfyUI but h3quant cannot convert or run it; "
            "only its tensor set is checked")
    if layer.weight is None:
        add("Q101", f"layer has a {spec.name} marker but no weight tensor")
        return out
    n, k = logical_shape(layer)
    if len(layer.weight.shape) != 2 and spec.storage.tensors[0].shapes is not None:
        add("Q103", f"weight is {_fmt_shape(layer.weight.shape)}, expected a 2-D "
            f"{spec.storage.tensors[0].describe()}")
    out.extend(spec.rules.header_findings(layer, n, k, add) or ())
    for ts in spec.storage.tensors:
        info = layer.tensors.get(ts.suffix)
        if info is None:
            if ts.required:
                add("Q101", f"{spec.name} layer lacks {layer.tensor_name(ts.suffix)} "
                    f"(expected {ts.describe()})", ts.suffix)
            continue
        if info.dtype not in ts.dtypes:
            add("Q102", f"is {info.dtype}, expected {ts.describe()} for {spec.name}", ts.suffix)
        if ts.shapes is None or n is None or k is None or spec.rules.skip_shape(ts.suffix, layer):
            continue
        allowed = ts.shapes(n, k, fields)
        if not _shape_ok(info.shape, allowed, ts.at_least):
            want = " or ".join(_fmt_shape(a) for a in allowed)
            add("Q103", f"is {_fmt_shape(info.shape)}, expected {ts.shape_text} = {want} "
                f"for N={n}, K={k}", ts.suffix)
    if spec.storage.closed:
        for suffix in sorted(set(layer.tensors) - spec.storage.suffixes):
            known = ", ".join(sorted(spec.storage.suffixes - {"comfy_quant"}))
            add("Q106", f"{spec.name} defines no '{suffix}' tensor (expected only {known}); "
                "loaders ignore or reject it", suffix)
    spec.rules.extra_findings(layer, add)
    if k is not None and spec.storage.convrot_rules:
        _constraints(spec, layer, k, add)
    if supported:  # rules across fields and tensors
        seen = {(f.code, f.tensor) for f in out}
        for v in spec.rules.combination_violations(layer.fields or {}, layer.tensors):
            if (v.code, layer.tensor_name(v.suffix)) not in seen:
                add(v.code, v.message, v.suffix)
    return out


def _constraints(spec: FormatSpec, layer, k: int, add) -> None:
    f = layer.fields
    if f.get("convrot", False) or spec.storage.always_convrot:
        g = f.get("convrot_groupsize", 256)
        if not is_valid_group_size(g):
            add("Q104", f"convrot_groupsize {g!r} is not a power of 4 (4, 16, 64, 256, 1024); "
                "ConvRot's Hadamard exists only for those sizes")
        elif k % g:
            add("Q104", f"K={k} is not divisible by convrot_groupsize {g}; every rotation block "
                "must be whole")
    spec.rules.constraints(layer, k, add)


# ---------------------------------------------------------------------------- data rules
def scale_violations(values: torch.Tensor) -> list[Violation]:
    """D101 (NaN / infinite) and D102 (zero / negative) for one scale tensor's values."""
    import torch

    v = values.float().reshape(-1)
    out: list[Violation] = []
    bad = ~torch.isfinite(v)
    if bad.any():
        first = int(bad.nonzero()[0, 0])
        out.append(Violation("D101", f"{int(bad.sum())} of {v.numel()} scale values are NaN or "
                             f"infinite (first at flat index {first}); expected finite scales"))
    nonpos = torch.isfinite(v) & (v <= 0)
    if nonpos.any():
        i = int(nonpos.nonzero()[0, 0])
        out.append(Violation("D102", f"{int(nonpos.sum())} of {v.numel()} scale values are <= 0 "
                             f"(first: {v[i].item()!r} at flat index {i}); expected positive "
                             "scales"))
    return out


def weight_violation(values: torch.Tensor, offset: int = 0) -> Violation | None:
    """D106 when a float weight chunk holds NaN or infinity (``offset``: its first flat index)."""
    import torch

    flat = values.reshape(-1)
    # Fast path: one sum instead of an isfinite pass (~70x cheaper on a bf16 chunk here; convert
    # checks every source weight). A sum is finite only if every term is (inf and NaN absorb in
    # IEEE addition); a finite chunk whose sum overflows goes on to the exact check below.
    if flat.is_floating_point() and bool(torch.isfinite(flat.sum())):
        return None
    bad = ~torch.isfinite(flat)
    if not bad.any():
        return None
    first = offset + int(bad.nonzero()[0, 0])
    return Violation("D106", f"{int(bad.sum())} non-finite weight value(s) (first at flat index "
                     f"{first}); expected finite weights")


# ComfyUI's scaled fp8: an fp8 weight with one of these float companions (and no marker)
FP8_SCALE_NAMES = ("scale_weight", "weight_scale")
FP8_ROWS = 1024  # rows of an fp8 weight decoded at once by the check below


def fp8_decoded_violation(codes: torch.Tensor, scale: torch.Tensor | None = None,
                          offset: int = 0) -> Violation | None:
    """D106 for (rows of) a ComfyUI scaled-fp8 weight: decoded as ComfyUI decodes it (the code
    in fp32 times the scale, per tensor or per row, rounded once) every value must be finite. A
    NaN code, an e5m2 infinity code, or a finite scale so large that code x scale overflows
    (3e38) each make a non-finite weight. One rule for every command: ``validate --deep``,
    convert (every target), verify and the fp8 codec call this function."""
    import torch

    w = codes.to(torch.float32)
    if scale is not None:
        s = scale.to(torch.float32).reshape(-1)
        if s.numel() == 1:
            w = w * s.reshape(())
        elif w.dim() >= 1 and s.numel() == w.shape[0]:
            w = w * s.reshape((-1,) + (1,) * (w.dim() - 1))
        else:
            w = w * s.reshape((-1,) + (1,) * (w.dim() - 1))[: w.shape[0]]
    return weight_violation(w, offset)


def fp8_weight_violation(codes: torch.Tensor, scale: torch.Tensor | None = None
                         ) -> Violation | None:
    """``fp8_decoded_violation`` over a whole weight, ``FP8_ROWS`` rows at a time."""
    if codes.dim() < 2:
        return fp8_decoded_violation(codes, scale)
    per_row = scale is not None and scale.numel() == codes.shape[0] and scale.numel() > 1
    k = codes[0].numel() if codes.shape[0] else 0
    for r0 in range(0, codes.shape[0], FP8_ROWS):
        part = scale.reshape(-1)[r0:r0 + FP8_ROWS] if per_row and scale is not None else scale
        v = fp8_decoded_violation(codes[r0:r0 + FP8_ROWS], part, r0 * k)
        if v is not None:
            return v
    return None
