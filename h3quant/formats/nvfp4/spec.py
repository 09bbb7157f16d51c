"""nvfp4 as data: wire name, marker fields, tensor set, and its header rules (torch-free).

Facts (docs/FORMATS.md, nvfp4): ComfyUI ``comfy/quant_ops.py`` registers ``nvfp4`` with storage
uint8, parameters ``weight_scale``, ``weight_scale_2``, ``input_scale``, ``pre_quant_scale`` and
group size 16; comfy-kitchen 0.2.40 ``tensor/nvfp4.py`` pads the weight to 16 x 16, packs two
e2m1 codes per byte and stores the e4m3 block scales in cuBLAS's blocked 128 x 4 layout.
"""

from __future__ import annotations

from h3quant.formats.rules.checks import Violation

NAME = "nvfp4"
DESCRIPTION = "fp4 e2m1 codes (two per byte) + e4m3 block scales (16, cuBLAS blocked) + fp32 tensor scale"
MARKER_DEFAULTS: dict = {}
BLOCK = 16
BITS_PER_WEIGHT = 4 + 8 / BLOCK  # codes + one e4m3 scale per 16 (the tensor scale aside)
FLOATS = ("F32", "F16", "BF16")

# (suffix, dtypes, shape in words, required)
TENSORS = (
    ("weight", ("U8",), "[Np, Kp/2]: N and K rounded up to 16, two codes per byte", True),
    ("weight_scale", ("F8_E4M3",), "[roundup(Np, 128), roundup(Kp/16, 4)] (blocked 128 x 4)", True),
    ("weight_scale_2", ("F32",), "[] (fp32 tensor scale)", True),
    ("input_scale", ("F32",), "[] (activation scale, unused by the weight)", False),
    ("pre_quant_scale", FLOATS, "[Kp] (unused by the weight)", False),
    ("bias", FLOATS, "[N]", False),
)
SUFFIXES = frozenset(t[0] for t in TENSORS)


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def logical_shape(shape: tuple, fields: dict | None) -> tuple[int, int]:
    """The (padded) logical ``[Np, Kp]`` of a stored ``[Np, Kp/2]`` weight."""
    return shape[0], 2 * shape[1]


def scale_shape(np_: int, kp: int) -> tuple[int, int]:
    return roundup(np_, 128), roundup(kp // BLOCK, 4)


def planned(n: int, k: int) -> dict[str, tuple[str, tuple]]:
    np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
    return {"weight": ("U8", (np_, kp // 2)), "weight_scale": ("F8_E4M3", scale_shape(np_, kp)),
            "weight_scale_2": ("F32", ())}


def _shape(t) -> tuple:
    return tuple(t.shape)


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Header rules of one nvfp4 layer: tensor set, dtypes, padded and blocked shapes."""
    out: list[Violation] = []
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", "nvfp4 layer has no weight (expected U8 [Np, Kp/2])")]
    if w.dtype != "U8":
        out.append(Violation("Q102", f"weight is {w.dtype}, expected U8 (two e2m1 codes per byte)"))
    if len(_shape(w)) != 2:
        return out + [Violation("Q103", f"weight is {list(_shape(w))}, expected a 2-D U8 [Np, Kp/2]")]
    np_, kp = logical_shape(_shape(w), fields)
    if np_ % BLOCK or kp % BLOCK:
        out.append(Violation("Q120", f"weight [{np_}, {kp // 2}] holds [{np_}, {kp}] codes; nvfp4 "
                             f"pads rows and columns to multiples of {BLOCK} (expected "
                             f"[{roundup(np_, BLOCK)}, {roundup(kp, BLOCK) // 2}])"))
    for suffix, dtypes, words, required in TENSORS[1:]:
        t = tensors.get(suffix)
        if t is None:
            if required:
                out.append(Violation("Q101", f"nvfp4 layer has no {suffix} (expected "
                                     f"{'/'.join(dtypes)} {words})", suffix))
            continue
        if t.dtype not in dtypes:
            out.append(Violation("Q102", f"{suffix} is {t.dtype}, expected {'/'.join(dtypes)} {words}",
                                 suffix))
    s = tensors.get("weight_scale")
    if s is not None:
        want = scale_shape(roundup(np_, BLOCK), roundup(kp, BLOCK))
        if _shape(s) != want:
            hint = (" (the unpadded row-major grid: not cuBLAS's blocked layout)"
                    if _shape(s) == (np_, kp // BLOCK) else "")
            out.append(Violation("Q103", f"weight_scale is {list(_shape(s))}, expected "
                                 f"{list(want)} for a [{np_}, {kp}] weight{hint}", "weight_scale"))
    for suffix in ("weight_scale_2", "input_scale"):
        t = tensors.get(suffix)
        if t is not None and _shape(t) not in ((), (1,)):
            out.append(Violation("Q103", f"{suffix} is {list(_shape(t))}, expected a scalar []",
                                 suffix))
    b = tensors.get("bias")
    if b is not None and len(_shape(b)) != 1:
        out.append(Violation("Q103", f"bias is {list(_shape(b))}, expected [N]", "bias"))
    return out
