"""Header and data rules of fp8 and mxfp8 layers (torch-free at import).

Header rules give ``Violation``s from dtypes and shapes alone (the weight's dtype, rank and the
bias are the engine's, ``FormatSpec.layer_violations``); the data rules read codes and scales.
Codes: Q101 a missing tensor, Q102 wrong dtype, Q103 wrong shape, D101/D102 non-finite or
non-positive scales, D130 codes that decode to NaN or infinity, D131 e8m0 block scales that are
NaN (0xFF). mxfp8's shape rules (Q130) are in ``h3quant.formats.mxfp8.spec``.
"""

from __future__ import annotations

from h3quant.formats.spec import Violation, shape_of


def input_scale_violations(tensors: dict) -> list[Violation]:
    i = tensors.get("input_scale")
    if i is not None and (i.dtype != "F32" or shape_of(i) not in ((), (1,))):
        return [Violation("Q103", f"input_scale is {i.dtype} {list(shape_of(i))}, expected "
                          "F32 []", "input_scale")]
    return []


def fp8_violations(name: str, tensors: dict) -> list[Violation]:
    """Rules of a per-tensor fp8 layer beyond its weight's dtype and rank."""
    n = shape_of(tensors["weight"])[0]
    out = input_scale_violations(tensors)
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", f"{name} layer has no weight_scale", "weight_scale")]
    if s.dtype != "F32":
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32", "weight_scale"))
    if shape_of(s) not in ((), (1,), (n,), (n, 1)):
        out.append(Violation("Q103", f"weight_scale shape {list(shape_of(s))} fits neither [] nor "
                             f"[{n}] nor [{n}, 1]", "weight_scale"))
    return out


# ----------------------------------------------------------------------------- data rules
def nonfinite_codes(codes) -> Violation | None:
    """D130 when fp8 codes decode to NaN or infinity (``codes``: an fp8 tensor chunk)."""
    import torch

    bad = int((~torch.isfinite(codes.to(torch.float32))).sum())
    if not bad:
        return None
    return Violation("D130", f"{bad} of {codes.numel()} fp8 codes decode to NaN or infinity; "
                     "an encoder clamps to the largest finite code")


def scale_violations(values) -> list[Violation]:
    """D101 (NaN / infinite) and D102 (zero / negative) for one fp32 scale tensor's values."""
    import torch

    v = values.float().reshape(-1)
    out = []
    bad = int((~torch.isfinite(v)).sum())
    if bad:
        out.append(Violation("D101", f"{bad} of {v.numel()} scale values are NaN or infinite; "
                             "expected finite scales", "weight_scale"))
    nonpos = int((torch.isfinite(v) & (v <= 0)).sum())
    if nonpos:
        out.append(Violation("D102", f"{nonpos} of {v.numel()} scale values are <= 0; expected "
                             "positive scales", "weight_scale"))
    return out


def e8m0_violation(scales) -> Violation | None:
    """D131 when e8m0 block scale bytes hold 0xFF (NaN)."""
    import torch

    raw = scales.reshape(-1).view(torch.uint8)
    bad = int((raw == 255).sum())
    if not bad:
        return None
    return Violation("D131", f"{bad} of {raw.numel()} e8m0 block scales are 0xFF (NaN); "
                     "expected exponents 0..254", "weight_scale")
