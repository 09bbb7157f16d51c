"""Header and data rules of fp8 and mxfp8 layers (torch-free at import).

Header rules give ``Violation``s from dtypes and shapes alone (the weight's dtype, rank and the
bias are the engine's, ``FormatSpec.layer_violations``); the data rules read codes and scales.
Codes: Q101 a missing tensor, Q102 wrong dtype, Q103 wrong shape, Q130 mxfp8 shapes that are
not 32-aligned or scales whose blocked (padded) shape disagrees with the weight, D130 codes that
decode to NaN or infinity, D131 e8m0 block scales that are NaN (0xFF).
"""

from __future__ import annotations

from h3quant.formats.spec import Violation, shape_of


def _input_scale(tensors: dict) -> list[Violation]:
    i = tensors.get("input_scale")
    if i is not None and (i.dtype != "F32" or shape_of(i) not in ((), (1,))):
        return [Violation("Q103", f"input_scale is {i.dtype} {list(shape_of(i))}, expected "
                          "F32 []", "input_scale")]
    return []


def fp8_violations(name: str, tensors: dict) -> list[Violation]:
    """Rules of a per-tensor fp8 layer beyond its weight's dtype and rank."""
    n = shape_of(tensors["weight"])[0]
    out = _input_scale(tensors)
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", f"{name} layer has no weight_scale", "weight_scale")]
    if s.dtype != "F32":
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32", "weight_scale"))
    if shape_of(s) not in ((), (1,), (n,), (n, 1)):
        out.append(Violation("Q103", f"weight_scale shape {list(shape_of(s))} fits neither [] nor "
                             f"[{n}] nor [{n}, 1]", "weight_scale"))
    return out


def mxfp8_shape_violations(tensors: dict) -> list[Violation]:
    """Q130: the padded shapes of an mxfp8 layer (weight dims, blocked scale shape)."""
    from h3quant.formats.mxfp8.spec import BLOCK, scale_shape

    w = tensors.get("weight")
    if w is None or len(shape_of(w)) != 2:
        return []
    n, k = shape_of(w)
    if n % BLOCK or k % BLOCK:
        return [Violation("Q130", f"weight is [{n}, {k}]: mxfp8 stores weights padded to "
                          f"multiples of {BLOCK} in both dims")]
    s = tensors.get("weight_scale")
    want = scale_shape(n, k)
    if s is not None and shape_of(s) != want:
        return [Violation("Q130", f"weight_scale is {list(shape_of(s))}, expected the blocked "
                          f"layout [roundup(N, 128), roundup(K/32, 4)] = {list(want)} for "
                          f"N={n}, K={k}", "weight_scale")]
    return []


def mxfp8_violations(tensors: dict) -> list[Violation]:
    """Rules of an mxfp8 layer beyond its weight's dtype and rank."""
    out = _input_scale(tensors)
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", "mxfp8 layer has no weight_scale", "weight_scale")]
    if s.dtype not in ("F8_E8M0", "U8"):
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F8_E8M0 (or U8 "
                             "bytes)", "weight_scale"))
    return out + mxfp8_shape_violations(tensors)


# ----------------------------------------------------------------------------- data rules
def nonfinite_codes(codes) -> Violation | None:
    """D130 when fp8 codes decode to NaN or infinity (``codes``: an fp8 tensor chunk)."""
    import torch

    bad = int((~torch.isfinite(codes.to(torch.float32))).sum())
    if not bad:
        return None
    return Violation("D130", f"{bad} of {codes.numel()} fp8 codes decode to NaN or infinity; "
                     "an encoder clamps to the largest finite code")


def e8m0_violation(scales) -> Violation | None:
    """D131 when e8m0 block scale bytes hold 0xFF (NaN)."""
    import torch

    raw = scales.reshape(-1).view(torch.uint8)
    bad = int((raw == 255).sum())
    if not bad:
        return None
    return Violation("D131", f"{bad} of {raw.numel()} e8m0 block scales are 0xFF (NaN); "
                     "expected exponents 0..254", "weight_scale")
