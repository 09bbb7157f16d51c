"""Header and data rules of fp8 and mxfp8 layers (torch-free at import).

Header rules give ``Violation``s (``formats.rules.checks``) from dtypes and shapes alone; the
data rules read codes and scales. Codes: Q102 wrong dtype, Q103 wrong shape, Q130 mxfp8 shapes
that are not 32-aligned or scales whose blocked (padded) shape disagrees with the weight,
D101/D102 non-finite or non-positive fp32 scales, D130 codes that decode to NaN or infinity,
D131 e8m0 block scales that are NaN (0xFF).
"""

from __future__ import annotations

from h3quant.formats.rules.checks import Violation

FLOATS = ("BF16", "F16", "F32", "F64")


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


def _common(name: str, tensors: dict, code_dtype: str) -> tuple[list[Violation], int | None]:
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", f"{name} layer has no weight")], None
    if w.dtype != code_dtype or len(_shape(w)) != 2:
        return [Violation("Q102", f"weight is {w.dtype} {list(_shape(w))}, {name} needs a 2-D "
                          f"{code_dtype} weight")], None
    out: list[Violation] = []
    n = _shape(w)[0]
    i = tensors.get("input_scale")
    if i is not None and (i.dtype != "F32" or _shape(i) not in ((), (1,))):
        out.append(Violation("Q103", f"input_scale is {i.dtype} {list(_shape(i))}, expected "
                             "F32 []", "input_scale"))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in FLOATS or _shape(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(_shape(b))}, expected a float "
                             f"[{n}]", "bias"))
    return out, n


def fp8_violations(name: str, code_dtype: str, tensors: dict) -> list[Violation]:
    """Header rules of a per-tensor fp8 layer."""
    out, n = _common(name, tensors, code_dtype)
    if n is None:
        return out
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", f"{name} layer has no weight_scale", "weight_scale")]
    if s.dtype != "F32":
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32", "weight_scale"))
    if _shape(s) not in ((), (1,), (n,), (n, 1)):
        out.append(Violation("Q103", f"weight_scale shape {list(_shape(s))} fits neither [] nor "
                             f"[{n}] nor [{n}, 1]", "weight_scale"))
    return out


def mxfp8_violations(tensors: dict) -> list[Violation]:
    """Header rules of an mxfp8 layer."""
    from h3quant.formats.mxfp8.spec import BLOCK, scale_shape

    out, n = _common("mxfp8", tensors, "F8_E4M3")
    if n is None:
        return out
    k = _shape(tensors["weight"])[1]
    if n % BLOCK or k % BLOCK:
        out.append(Violation("Q130", f"weight is [{n}, {k}]: mxfp8 stores weights padded to "
                             f"multiples of {BLOCK} in both dims"))
        return out
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", "mxfp8 layer has no weight_scale", "weight_scale")]
    if s.dtype not in ("F8_E8M0", "U8"):
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F8_E8M0 (or U8 "
                             "bytes)", "weight_scale"))
    want = scale_shape(n, k)
    if _shape(s) != want:
        out.append(Violation("Q130", f"weight_scale is {list(_shape(s))}, expected the blocked "
                             f"layout [roundup(N, 128), roundup(K/32, 4)] = {list(want)} for "
                             f"N={n}, K={k}", "weight_scale"))
    return out


def first(found: list[Violation]) -> str | None:
    if not found:
        return None
    v = found[0]
    return f"[{v.code}] {v.suffix}: {v.message}" if v.suffix != "weight" else \
        f"[{v.code}] {v.message}"


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
