"""AWQ W4A16 (``awq_w4a16``) as data: wire name, marker fields, tensors, header rules.

Facts (docs/FORMATS.md, awq_w4a16): comfy-kitchen 0.2.40 ``tensor/awq_w4a16.py`` (the layout
ComfyUI loads for ``awq_w4a16``): weight int8 [N, K/2] with unsigned 4-bit codes (even column
low), ``weight_scale`` and ``weight_zeros`` [K/G, N] in the compute dtype (fp16 / bf16), group
size ``G`` 64 unless the marker's ``group_size`` says otherwise; kitchen has no quantizer (the
format needs calibration).
"""

from __future__ import annotations

from h3quant.formats.rules.checks import Violation

NAME = "awq_w4a16"
DESCRIPTION = "AWQ: unsigned int4 codes (two per byte) + fp16/bf16 group scales and zero points"
MARKER_DEFAULTS = {"group_size": 64}
SCALE_DTYPES = ("F16", "BF16", "F32")
BITS_PER_WEIGHT = 4.0  # plus two 16-bit values per group of G
FLOATS = ("F32", "F16", "BF16")

TENSORS = (
    ("weight", ("I8",), "[N, K/2]: two unsigned 4-bit codes per byte, even column low", True),
    ("weight_scale", SCALE_DTYPES, "[K/G, N]", True),
    ("weight_zeros", SCALE_DTYPES, "[K/G, N], the weight_scale's dtype", True),
    ("bias", FLOATS, "[N]", False),
)
SUFFIXES = frozenset(t[0] for t in TENSORS)
REFUSAL = ("awq_w4a16 is written from activation statistics (AWQ calibration); h3quant can read, "
           "check, decode and convert from it, but writing it needs calibration data")


def logical_shape(shape: tuple, fields: dict | None) -> tuple[int, int]:
    return shape[0], 2 * shape[1]


def _shape(t) -> tuple:
    return tuple(t.shape)


def rules(fields: dict, tensors: dict) -> list[Violation]:
    out: list[Violation] = []
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", "awq_w4a16 layer has no weight (expected I8 [N, K/2])")]
    if w.dtype != "I8":
        out.append(Violation("Q102", f"weight is {w.dtype}, expected I8 (two uint4 codes per byte)"))
    if len(_shape(w)) != 2:
        return out + [Violation("Q103", f"weight is {list(_shape(w))}, expected a 2-D I8 [N, K/2]")]
    n, k = logical_shape(_shape(w), fields)
    g = fields.get("group_size", 64)
    good_g = isinstance(g, int) and not isinstance(g, bool) and g > 0 and k % g == 0
    if not good_g:
        out.append(Violation("Q123", f"group_size {g!r} does not divide K={k}"))
    for suffix in ("weight_scale", "weight_zeros"):
        t = tensors.get(suffix)
        if t is None:
            out.append(Violation("Q101", f"awq_w4a16 layer has no {suffix} (expected F16/BF16 "
                                 "[K/G, N])", suffix))
            continue
        if t.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"{suffix} is {t.dtype}, expected F16/BF16 [K/G, N]",
                                 suffix))
        if good_g and _shape(t) != (k // g, n):
            out.append(Violation("Q103", f"{suffix} is {list(_shape(t))}, expected [K/G, N] = "
                                 f"[{k // g}, {n}]", suffix))
    s, z = tensors.get("weight_scale"), tensors.get("weight_zeros")
    if s is not None and z is not None and s.dtype != z.dtype:
        out.append(Violation("Q123", f"weight_zeros is {z.dtype} but weight_scale is {s.dtype}; "
                             "they share the compute dtype", "weight_zeros"))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in FLOATS or _shape(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(_shape(b))}, expected a float [{n}]",
                             "bias"))
    return out
