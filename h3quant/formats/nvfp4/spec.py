"""nvfp4 as data: wire name, marker fields, tensor set, and its header rules (torch-free).

Facts (docs/FORMATS.md, nvfp4): ComfyUI ``comfy/quant_ops.py`` registers ``nvfp4`` with storage
uint8, parameters ``weight_scale``, ``weight_scale_2``, ``input_scale``, ``pre_quant_scale`` and
group size 16; comfy-kitchen 0.2.40 ``tensor/nvfp4.py`` pads the weight to 16 x 16, packs two
e2m1 codes per byte and stores the e4m3 block scales in cuBLAS's blocked 128 x 4 layout.
"""

from __future__ import annotations

from h3quant.formats.spec import FormatSpec, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (packed_weight, BIAS, FLOATS, Target, TensorSpec, VerifyLimits,
                                  Violation, scalar, shape_of)
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q120", "fp4-padded-shape", Severity.ERROR,
         "nvfp4: the stored weight [Np, Kp/2] has Np and Kp multiples "
         "of 16 (the padded logical shape)")
register("D120", "block-scale-value", Severity.ERROR,
         "nvfp4: e4m3 block scales are finite and >= 0, and a zero "
         "block scale covers only zero codes")
register("D121", "block-scale-layout", Severity.ERROR,
         "nvfp4: block scales are stored in cuBLAS's blocked 128 x 4 "
         "layout (zeros in its padding); a row-major grid decodes blocks with other blocks' scales")

NAME = "nvfp4"
BLOCK = 16
BITS_PER_WEIGHT = 4 + 8 / BLOCK  # codes + one e4m3 scale per 16 (the tensor scale aside)


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def scale_shape(np_: int, kp: int) -> tuple[int, int]:
    """The blocked block-scale shape of a padded ``[np_, kp]`` weight."""
    return roundup(np_, 128), roundup(kp // BLOCK, 4)


def _scale_shapes(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return [scale_shape(roundup(n, BLOCK), roundup(k, BLOCK))]


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Every header rule of one nvfp4 layer (what convert and the runtime refuse by)."""
    out, logical = packed_weight("nvfp4", tensors, "U8", "e2m1 codes", "[Np, Kp/2]")
    if logical is None:
        return out
    np_, kp = logical
    if np_ % BLOCK or kp % BLOCK:
        out.append(Violation("Q120", padded_message(np_, kp)))
    for ts in SPEC.storage.tensors[1:]:
        t = tensors.get(ts.suffix)
        if t is None:
            if ts.required:
                out.append(Violation("Q101", f"nvfp4 layer has no {ts.suffix} (expected "
                                     f"{ts.describe()})", ts.suffix))
            continue
        if t.dtype not in ts.dtypes:
            out.append(Violation("Q102", f"{ts.suffix} is {t.dtype}, expected {ts.describe()}",
                                 ts.suffix))
        if ts.shapes is not None and shape_of(t) not in ts.shapes(np_, kp, fields):
            out.append(Violation("Q103", f"{ts.suffix} is {list(shape_of(t))}, expected "
                                 f"{ts.shape_text} = {list(ts.shapes(np_, kp, fields)[0])} for a "
                                 f"[{np_}, {kp}] weight", ts.suffix))
    return out


def padded_message(np_: int, kp: int) -> str:
    return (f"weight [{np_}, {kp // 2}] holds [{np_}, {kp}] codes; nvfp4 pads rows and columns "
            f"to multiples of {BLOCK} (expected [{roundup(np_, BLOCK)}, {roundup(kp, BLOCK) // 2}])")


class NVFP4Planning(PlanningFacet):
    """nvfp4: what convert plans for it."""

    def marker(self, target, group_size):
        return {"format": NAME}

    def same_target(self, layer, fields, marker):
        return fields["format"] == NAME

    def skip_reason(self, k, marker):
        if k % BLOCK:
            return f"K={k} is not a multiple of {BLOCK} (nvfp4 would pad it)"
        return None

    def planned(self, n, k, marker):
        np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
        return {"weight": ("U8", (np_, kp // 2)), "weight_scale": ("F8_E4M3", scale_shape(np_, kp)),
                "weight_scale_2": ("F32", ())}

    def keep_declared(self, suffix, dtype, shape, n):
        return dtype, (() if suffix == "weight_scale_2" else shape)


class NVFP4Rules(RulesFacet):
    """nvfp4: its header rules."""

    def layer_violations(self, fields, tensors):
        return rules(fields, tensors)

    def extra_findings(self, layer, add):
        w = layer.weight
        if w is not None and len(w.shape) == 2 and (w.shape[0] % BLOCK or (2 * w.shape[1]) % BLOCK):
            add("Q120", padded_message(w.shape[0], 2 * w.shape[1]))


SPEC = FormatSpec(
    name=NAME,
    description="fp4 e2m1 codes (two per byte) + e4m3 block scales (16, cuBLAS blocked) + fp32 "
                "tensor scale",
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("U8",), lambda n, k, f: [(n, k // 2)],
                       "[Np, Kp/2] (N, K rounded up to 16; two codes per byte)"),
            TensorSpec("weight_scale", ("F8_E4M3",), _scale_shapes,
                       "[roundup(Np, 128), roundup(Kp/16, 4)] (cuBLAS blocked 128 x 4)"),
            TensorSpec("weight_scale_2", ("F32",), scalar, "[] (fp32 tensor scale)"),
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
            TensorSpec("pre_quant_scale", FLOATS, None, "[Kp]", required=False),
            BIAS,
        ),
        packed=True,
    ),
    encoding=EncodingFacet(
        targets=(Target("nvfp4", NAME, False,
                        "fp4 e2m1 with e4m3 block scales per 16 and an fp32 tensor scale"),),
        chunked=False,  # the tensor scale is the whole layer's amax: a first pass, then row
        streamed=True,  # chunks of 128-row multiples (the blocked scales' tiles)
        chunk_rows=128,
        unrowed_outputs=("weight_scale", "weight_scale_2"),
        calibrates=True,
        scans=True,  # the tensor scale is the layer's amax: a first pass over the rows
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts("TensorCoreNVFP4Layout", (10, 0), "0.2.0"),
        tensors=("weight", "weight_scale", "weight_scale_2"),
        required=("weight", "weight_scale", "weight_scale_2"),
        decodes=True,  # the runtime runs it through decode_weight (ComfyUI's dequantizing path)
        kernel=("nvfp4 scaled_mm (comfy-kitchen TensorCoreNVFP4Layout)", (10, 0)),
        needs_row0=True,  # block scales are laid out by 128-row tile, not by row
    ),
    verify=VerifyFacet(
        # measured on synthetic tiny files (6 seeds): layer rel err 0.092-0.106, block SQNR
        # 11.1-18.1 dB; full dims: weight rel err 0.081-0.083 (docs/benchmarks.md)
        limits=VerifyLimits(rel_err=0.15, block_sqnr_db=9.0),
        deep_scales=("weight_scale_2",),
        weight_bits=4,
    ),
    planning=NVFP4Planning(),
    rules=NVFP4Rules(),
)
