"""SVDQuant W4A4 (``svdquant_w4a4``) as data: wire name, marker fields, tensors, header rules.

Facts (docs/FORMATS.md, svdquant_w4a4): comfy-kitchen 0.2.40 ``tensor/svdquant_w4a4.py``
(``TensorCoreSVDQuantW4A4Layout``): weight int8 [N, K/2] (signed 4-bit codes, even column low),
``weight_scale`` [K/64, N] in the compute dtype, ``proj_down`` [K, R], ``proj_up`` [N, R],
``smooth_factor`` [K]; its ``state_dict_tensors`` names them ``weight_proj_down``,
``weight_proj_up``, ``weight_smooth_factor``, while Comfy-Org's comfy-quants converter writes
``proj_down``, ``proj_up``, ``smooth_factor``. Only the natural row-major storage is read (the
``kitchen_tile_packed_w4a4`` layout is refused). Stock ComfyUI does not register the format (its
loader is an open pull request), so h3quant reads it and never writes it.
"""

from __future__ import annotations

from h3quant.findings import Severity, register
from h3quant.formats.spec import FormatSpec, ReadingFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import (BIAS, TensorSpec, VerifyLimits, Violation,
                                  packed_weight, shape_of)

NAME = "svdquant_w4a4"
GROUP = 64
FLOATS = ("F16", "BF16", "F32")
# (proj_down, proj_up, smooth_factor) suffixes: comfy-kitchen's state_dict, then comfy-quants'
SPELLINGS = (("weight_proj_down", "weight_proj_up", "weight_smooth_factor"),
             ("proj_down", "proj_up", "smooth_factor"))
NATURAL = ("natural", "row_major")
# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q124", "svdquant-tensors", Severity.ERROR,
         "svdquant_w4a4: the low-rank and smoothing tensors come in one "
         "spelling (weight_proj_down, weight_proj_up, weight_smooth_factor or proj_down, proj_up, "
         "smooth_factor), float, proj_down [K, R], proj_up [N, R], smooth_factor [K]")
register("Q125", "svdquant-layout", Severity.ERROR,
         "svdquant_w4a4: natural row-major storage, group size 64, K a "
         "multiple of 64 (a tile-packed file is not read)")

READ_ONLY = ("svdquant_w4a4 layers are read only: stock ComfyUI does not register the format and "
             "writing it needs SVDQuant calibration; convert them to another format (for "
             "example --to bf16, or --layer 'PATTERN=bf16' for the layers left out)")


def spelling(tensors) -> tuple[str, str, str] | None:
    """The suffixes (proj_down, proj_up, smooth_factor) a layer uses: the spelling of which it
    holds every tensor (kitchen's first), None when it holds neither completely."""
    for names in SPELLINGS:
        if all(s in tensors for s in names):
            return names
    return None


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Every header rule of one svdquant_w4a4 layer (what convert and the runtime refuse by)."""
    out, logical = packed_weight(NAME, tensors, "I8", "int4 codes", "[N, K/2]")
    layout = fields.get("layout", "natural")
    if layout not in NATURAL:
        out.append(Violation("Q125", f"layout {layout!r}: only the natural row-major storage is "
                             "read (a tile-packed file needs comfy-kitchen's repacking first)"))
    g = fields.get("group_size", GROUP)
    if g != GROUP:
        out.append(Violation("Q125", f"group_size {g!r}: the SVDQuant int4 kernel's group is "
                             f"{GROUP}"))
    if logical is None:
        return out
    n, k = logical
    if k % GROUP:
        out.append(Violation("Q125", f"K={k} is not a multiple of the group size {GROUP}"))
    s = tensors.get("weight_scale")
    if s is None:
        out.append(Violation("Q101", f"{NAME} layer has no weight_scale (expected "
                             f"{'/'.join(FLOATS)} [K/64, N])", "weight_scale"))
    else:
        if s.dtype not in FLOATS:
            out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected "
                                 f"{'/'.join(FLOATS)}", "weight_scale"))
        if shape_of(s) != (k // GROUP, n):
            out.append(Violation("Q103", f"weight_scale is {list(shape_of(s))}, expected "
                                 f"[{k // GROUP}, {n}] ([K/64, N])", "weight_scale"))
    out.extend(_extras(n, k, tensors))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in FLOATS or shape_of(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(shape_of(b))}, expected a float "
                             f"[{n}]", "bias"))
    return out


def _extras(n: int, k: int, tensors: dict) -> list[Violation]:
    """The low-rank and smoothing tensors: one complete spelling, float, shapes that agree."""
    held = [[s for s in names if s in tensors] for names in SPELLINGS]
    if held[0] and held[1]:
        return [Violation("Q124", f"layer mixes two spellings ({', '.join(held[0] + held[1])}); "
                          "a loader reads one of them", held[1][0])]
    names = spelling(tensors)
    if names is None:
        part = SPELLINGS[1] if held[1] else SPELLINGS[0]
        missing = [s for s in part if s not in tensors]
        return [Violation("Q101", f"{NAME} layer lacks {', '.join(missing)} (the low-rank "
                          "branch and the input smoothing)", missing[0])]
    down, up, smooth = (tensors[s] for s in names)
    out = [Violation("Q102", f"{s} is {t.dtype}, expected {'/'.join(FLOATS)}", s)
           for s, t in zip(names, (down, up, smooth)) if t.dtype not in FLOATS]
    r = shape_of(down)[1] if len(shape_of(down)) == 2 else None
    if len(shape_of(down)) != 2 or shape_of(down)[0] != k or not r:
        out.append(Violation("Q124", f"{names[0]} is {list(shape_of(down))}, expected [{k}, R] "
                             "(R >= 1)", names[0]))
    if shape_of(up) != (n, r):
        want = f"[{n}, {r}]" if r else f"[{n}, R]"
        out.append(Violation("Q124", f"{names[1]} is {list(shape_of(up))}, expected {want} "
                             f"(the rank of {names[0]})", names[1]))
    if shape_of(smooth) != (k,):
        out.append(Violation("Q124", f"{names[2]} is {list(shape_of(smooth))}, expected [{k}]",
                             names[2]))
    return out


class SVDQuantW4A4Reading(ReadingFacet):
    """svdquant_w4a4: how a layer reads (its description)."""

    def describe(self, fields):
        f = fields or {}
        return NAME + (" act_unsigned" if f.get("act_unsigned") is True else "")


class SVDQuantW4A4Rules(RulesFacet):
    """svdquant_w4a4: its header rules."""

    def layer_violations(self, fields, tensors):
        return rules(fields, tensors)

    def skip_shape(self, suffix, layer):
        return suffix == "weight_scale"  # judged with K by the rules (extra_findings)

    def extra_findings(self, layer, add):
        seen = set()
        for v in rules(layer.fields or {}, layer.tensors):
            if v.code == "Q102" or (v.code in ("Q101", "Q103") and v.suffix == "weight"):
                continue  # the tensor-set check reports dtypes and the weight's own rules
            if (v.code, v.suffix) not in seen:
                seen.add((v.code, v.suffix))
                add(v.code, v.message, v.suffix)


def _required(names):
    return tuple(TensorSpec(s, FLOATS, None, shape, required=False)
                 for s, shape in zip(names, ("[K, R]", "[N, R]", "[K]")))


SPEC = FormatSpec(
    name=NAME,
    description="SVDQuant: signed int4 codes (two per byte) + group scales, a low-rank branch "
                "and input smoothing (read only)",
    comfy=False,  # stock ComfyUI does not register it (docs/FORMATS.md)
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k // 2)],
                       "[N, K/2] (two signed 4-bit codes per byte, even column low)"),
            TensorSpec("weight_scale", FLOATS, lambda n, k, f: [(k // GROUP, n)], "[K/64, N]"),
            *_required(SPELLINGS[0]),
            *_required(SPELLINGS[1]),
            BIAS,
        ),
        marker_defaults={"group_size": GROUP},
        packed=True,
    ),
    encoding=EncodingFacet(
        chunked=False,
        write_refusal=READ_ONLY,
        kept_refusal=READ_ONLY,
    ),
    runtime=RuntimeFacet(
        tensors=("weight", "weight_scale") + SPELLINGS[0] + SPELLINGS[1],
        required=("weight", "weight_scale"),
        decodes=True,  # the runtime runs it through decode_weight (kitchen's dequantize)
        # No ComfyUI kernel: stock ComfyUI does not load the format (comfy-kitchen's CUDA kernel
        # needs sm_80; docs/FORMATS.md), so every device runs the dequantized weight.
    ),
    verify=VerifyFacet(
        # the 4-bit class's limits (those of convrot_w4a4); not measured on SVDQuant files
        limits=VerifyLimits(rel_err=0.35, block_sqnr_db=4.0),
        deep_scales=(SPELLINGS[0][2], SPELLINGS[1][2]),  # the smoothing divides the activations
        weight_bits=4,
    ),
    reading=SVDQuantW4A4Reading(),
    rules=SVDQuantW4A4Rules(),
)
