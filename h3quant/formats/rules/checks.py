"""One rule set for the supported quantized formats, used by ``validate``, ``convert`` and
``verify`` alike, so the three commands give the same verdict on the same file.

Tensor rules (header only: dtypes, shapes, marker field combinations; ``layer_violations``) and
data rules (finite positive scales, finite float weights). The verdicts on the cases the
commands could disagree on are listed in docs/verify.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3quant.convrot.groups import is_valid_group_size

if TYPE_CHECKING:
    import torch

INT8 = "int8_tensorwise"
INT8_KN = "int8_tensorwise_kn"  # the same math, weight stored transposed [K, N]
W4A8 = "asym_w4a8_int8"

SCALE_DTYPES = ("F32",)
S_REL_DTYPES = ("F8_E4M3", "U8")
W4A8_GROUP = 16


def int8_scale_shapes(n: int) -> list[tuple[int, ...]]:
    return [(n, 1), (), (n,), (1,)]


def w4a8_channel_shapes(n: int) -> list[tuple[int, ...]]:
    return [(n,)]


@dataclass(frozen=True)
class Violation:
    code: str
    message: str
    suffix: str = "weight"


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def combination_violations(fmt: str, fields: dict, tensors: dict) -> list[Violation]:
    """Rules across a layer's marker fields and tensors (beyond one tensor's dtype/shape)."""
    out: list[Violation] = []
    if fmt == INT8:
        s = tensors.get("weight_scale")
        if fields.get("convrot") and s is not None and _shape(s) in ((), (1,)):
            out.append(Violation("Q103", "ConvRot int8 layers need per-row scales ([N, 1] or "
                                 f"[N]), got a single scale {list(_shape(s))}", "weight_scale"))
    elif fmt == W4A8 and fields.get("convrot") is False:
        out.append(Violation("M114", "asym_w4a8_int8 always uses ConvRot; the marker says "
                             "convrot=false"))
    return out


def layer_violations(fmt: str, fields: dict, tensors: dict) -> list[Violation]:
    """Every tensor rule of an ``int8_tensorwise`` / ``asym_w4a8_int8`` layer. ``tensors`` maps
    suffix -> an object with ``dtype`` (safetensors name) and ``shape``."""
    out: list[Violation] = []
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", f"{fmt} layer has no weight")]
    if w.dtype != "I8" or len(_shape(w)) != 2:
        return [Violation("Q102", f"weight is {w.dtype} {list(_shape(w))}, {fmt} needs a 2-D I8 "
                          "weight")]
    n, cols = _shape(w)
    if fmt == INT8_KN:
        k, n = n, cols
        s = tensors.get("weight_scale")
        if s is None:
            out.append(Violation("Q101", f"{fmt} layer has no weight_scale", "weight_scale"))
        elif s.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32",
                                 "weight_scale"))
        elif _shape(s) != (n,):
            out.append(Violation("Q109", f"weight_scale is {list(_shape(s))}, expected F32 [{n}] "
                                 f"for a [K, N] = [{k}, {n}] kn weight", "weight_scale"))
    elif fmt == INT8:
        k = cols
        s = tensors.get("weight_scale")
        if s is None:
            out.append(Violation("Q101", f"{fmt} layer has no weight_scale", "weight_scale"))
        else:
            if s.dtype not in SCALE_DTYPES:
                out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32",
                                     "weight_scale"))
            if _shape(s) not in int8_scale_shapes(n):
                out.append(Violation("Q103", f"weight_scale shape {list(_shape(s))} fits neither "
                                     f"[] nor [{n}] nor [{n}, 1]", "weight_scale"))
    elif fmt == W4A8:
        k = 2 * cols
        gs = fields.get("group_size", W4A8_GROUP)
        if not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0 or k % gs:
            out.append(Violation("Q104", f"group_size {gs!r} does not divide K={k}"))
            gs = None
        for suffix in ("weight_s_rel", "weight_s_channel"):
            if suffix not in tensors:
                out.append(Violation("Q101", f"{fmt} layer has no {suffix}", suffix))
        r = tensors.get("weight_s_rel")
        if r is not None and gs and (r.dtype not in S_REL_DTYPES or _shape(r) != (n, k // gs)):
            out.append(Violation("Q103", f"weight_s_rel is {r.dtype} {list(_shape(r))}, expected "
                                 f"F8_E4M3 [{n}, {k // gs}]", "weight_s_rel"))
        sc = tensors.get("weight_s_channel")
        if sc is not None and sc.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"weight_s_channel is {sc.dtype}, expected F32",
                                 "weight_s_channel"))
        if sc is not None and _shape(sc) not in w4a8_channel_shapes(n):
            out.append(Violation("Q103", f"weight_s_channel is {list(_shape(sc))}, expected "
                                 f"[{n}]", "weight_s_channel"))
        cb = tensors.get("weight_codebook")
        if cb is not None and (cb.dtype not in SCALE_DTYPES or _shape(cb) != (16,)):
            out.append(Violation("Q103", f"weight_codebook is {cb.dtype} {list(_shape(cb))}, "
                                 "expected F32 [16]", "weight_codebook"))
        if k % 16:
            out.append(Violation("Q108", f"K={k} is not a multiple of 16"))
    else:
        return out
    out.extend(combination_violations(fmt, fields, tensors))
    if fields.get("convrot") or fmt == W4A8:  # (kn: k is the stored row count)
        g = fields.get("convrot_groupsize", 256)
        if not is_valid_group_size(g) or k % g:
            out.append(Violation("Q104", f"convrot_groupsize {g!r} is not a power of 4 dividing "
                                 f"K={k}"))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in ("F32", "F16", "BF16", "F64") or _shape(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(_shape(b))}, expected a float "
                             f"[{n}]", "bias"))
    return out


def fit_error(fmt: str, layer, fields: dict) -> str | None:
    """The first tensor-rule violation of ``layer`` as one line (what convert refuses), or None."""
    found = layer_violations(fmt, fields, layer.tensors)
    if not found:
        return None
    v = found[0]
    return f"[{v.code}] {v.suffix}: {v.message}" if v.suffix != "weight" else \
        f"[{v.code}] {v.message}"


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
        part = scale.reshape(-1)[r0:r0 + FP8_ROWS] if per_row else scale
        v = fp8_decoded_violation(codes[r0:r0 + FP8_ROWS], part, r0 * k)
        if v is not None:
            return v
    return None


CODEBOOK_LEVELS = 16


def codebook_violation(levels: torch.Tensor) -> Violation | None:
    """A W4A8 codebook must hold 16 finite levels in [-1, 1], sorted ascending (D104). The
    encoder's nearest-level search and the decoders assume it; convert and verify refuse a
    layer that breaks it, validate --deep reports it."""
    import torch

    levels = levels.float().reshape(-1)
    problems = []
    if levels.numel() != CODEBOOK_LEVELS:
        problems.append(f"{levels.numel()} levels (expected {CODEBOOK_LEVELS})")
    finite = bool(torch.isfinite(levels).all())
    if not finite:
        problems.append("non-finite levels")
    elif levels.numel() and (levels.abs() > 1).any():
        problems.append(f"levels outside [-1, 1] (max |level| {levels.abs().max().item():.6g})")
    if levels.numel() > 1 and finite and (levels[1:] < levels[:-1]).any():
        problems.append("levels not sorted ascending")
    if not problems:
        return None
    return Violation("D104", "codebook has " + ", ".join(problems) + "; expected 16 sorted "
                     "finite levels in [-1, 1]", "weight_codebook")
