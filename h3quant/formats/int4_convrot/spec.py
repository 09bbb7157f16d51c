"""INT4 ConvRot (``convrot_w4a4``) as data: wire name, marker fields, tensors, header rules.

Facts (docs/FORMATS.md, convrot_w4a4): ComfyUI ``comfy/quant_ops.py`` registers
``convrot_w4a4`` with storage int8 and parameter ``weight_scale``; its loader reads the marker's
``convrot_groupsize`` (default 256) and ``linear_dtype`` (``int4`` or ``int8``, default ``int4``)
and fixes ``quant_group_size`` at 64 (not serialized); comfy-kitchen 0.2.40
``tensor/convrot_w4a4.py`` packs signed codes in [-7, 7] two per byte and keeps one fp32
scale per row.
"""

from __future__ import annotations

from h3quant.convrot.groups import is_valid_group_size
from h3quant.formats.rules.checks import Violation

NAME = "convrot_w4a4"
DESCRIPTION = "INT4 ConvRot: signed int4 codes (two per byte) + fp32 row scales, ConvRot always on"
MARKER_DEFAULTS = {"convrot_groupsize": 256, "linear_dtype": "int4"}
QUANT_GROUP = 64
LINEAR_DTYPES = ("int4", "int8")
BITS_PER_WEIGHT = 4.0  # plus one fp32 scale per row
FLOATS = ("F32", "F16", "BF16")

TENSORS = (
    ("weight", ("I8",), "[N, K/2]: two signed 4-bit codes per byte, even column low", True),
    ("weight_scale", ("F32",), "[N] (or [N, 1]): one scale per row", True),
    ("bias", FLOATS, "[N]", False),
)
SUFFIXES = frozenset(t[0] for t in TENSORS)


def logical_shape(shape: tuple, fields: dict | None) -> tuple[int, int]:
    return shape[0], 2 * shape[1]


def marker(group_size: int = 256) -> dict:
    """The canonical marker h3quant writes (key order is part of the bytes)."""
    return {"format": NAME, "convrot_groupsize": int(group_size)}


def k_error(k: int, g) -> str | None:
    if not isinstance(g, int) or isinstance(g, bool) or not is_valid_group_size(g):
        return f"convrot_groupsize {g!r} is not a power of 4 (4, 16, 64, 256, 1024)"
    if k % g:
        return f"K={k} is not divisible by convrot_groupsize {g}"
    return None


def _shape(t) -> tuple:
    return tuple(t.shape)


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Header rules of one convrot_w4a4 layer."""
    out: list[Violation] = []
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", "convrot_w4a4 layer has no weight (expected I8 [N, K/2])")]
    if w.dtype != "I8":
        out.append(Violation("Q102", f"weight is {w.dtype}, expected I8 (two int4 codes per byte)"))
    if len(_shape(w)) != 2:
        return out + [Violation("Q103", f"weight is {list(_shape(w))}, expected a 2-D I8 [N, K/2]")]
    n, k = logical_shape(_shape(w), fields)
    s = tensors.get("weight_scale")
    if s is None:
        out.append(Violation("Q101", "convrot_w4a4 layer has no weight_scale (expected F32 [N])",
                             "weight_scale"))
    else:
        if s.dtype != "F32":
            out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32 [N]",
                                 "weight_scale"))
        if _shape(s) not in ((n,), (n, 1)):
            out.append(Violation("Q103", f"weight_scale is {list(_shape(s))}, expected [{n}] "
                                 "(one scale per row)", "weight_scale"))
    why = k_error(k, fields.get("convrot_groupsize", 256))
    if why:
        out.append(Violation("Q104", why))
    qg = fields.get("quant_group_size", QUANT_GROUP)
    if qg != QUANT_GROUP or k % QUANT_GROUP:
        out.append(Violation("Q121", f"the int4 kernel needs quant_group_size {QUANT_GROUP} and K "
                             f"divisible by it (quant_group_size {qg!r}, K={k})"))
    ld = fields.get("linear_dtype", "int4")
    if ld not in LINEAR_DTYPES:
        out.append(Violation("Q122", f"linear_dtype {ld!r} is neither 'int4' nor 'int8'"))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in FLOATS or _shape(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(_shape(b))}, expected a float [{n}]",
                             "bias"))
    return out
