"""AWQ W4A16 (``awq_w4a16``) as data: wire name, marker fields, tensors, header rules.

Facts (docs/FORMATS.md, awq_w4a16): comfy-kitchen 0.2.40 ``tensor/awq_w4a16.py`` (the layout
ComfyUI loads for ``awq_w4a16``): weight int8 [N, K/2] with unsigned 4-bit codes (even column
low), ``weight_scale`` and ``weight_zeros`` [K/G, N] in the compute dtype (fp16 / bf16), group
size ``G`` 64 unless the marker's ``group_size`` says otherwise; kitchen has no quantizer (the
format needs calibration).
"""

from __future__ import annotations

from h3quant.formats.spec import FormatSpec, ReadingFacet, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (packed_weight, BIAS, Target, TensorSpec, VerifyLimits, Violation,
                                  shape_of)
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q123", "awq-group", Severity.ERROR,
         "awq_w4a16: group_size divides K; weight_scale and weight_zeros share "
         "one dtype")

NAME = "awq_w4a16"
SCALE_DTYPES = ("F16", "BF16", "F32")
BITS_PER_WEIGHT = 4.0  # plus two 16-bit values per group of G
REFUSAL = ("awq_w4a16 is written from activation statistics (AWQ calibration); h3quant can read, "
           "check, decode and convert from it, but writing it needs calibration data")


def _group(fields: dict, k: int) -> int | None:
    g = fields.get("group_size", 64)
    ok = isinstance(g, int) and not isinstance(g, bool) and g > 0 and k % g == 0
    return g if ok else None


def _group_rules(k: int, fields: dict, tensors: dict) -> list[Violation]:
    out = []
    if _group(fields, k) is None:
        out.append(Violation("Q123", f"group_size {fields.get('group_size', 64)!r} does not "
                             f"divide K={k}"))
    s, z = tensors.get("weight_scale"), tensors.get("weight_zeros")
    if s is not None and z is not None and s.dtype != z.dtype:
        out.append(Violation("Q123", f"weight_zeros is {z.dtype} but weight_scale is {s.dtype}; "
                             "they share the compute dtype", "weight_zeros"))
    return out


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Every header rule of one awq_w4a16 layer."""
    out, logical = packed_weight("awq_w4a16", tensors, "I8", "uint4 codes", "[N, K/2]")
    if logical is None:
        return out
    n, k = logical
    g = _group(fields, k)
    for suffix in ("weight_scale", "weight_zeros"):
        t = tensors.get(suffix)
        if t is None:
            out.append(Violation("Q101", f"awq_w4a16 layer has no {suffix} (expected F16/BF16 "
                                 "[K/G, N])", suffix))
            continue
        if t.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"{suffix} is {t.dtype}, expected F16/BF16 [K/G, N]",
                                 suffix))
        if g is not None and shape_of(t) != (k // g, n):
            out.append(Violation("Q103", f"{suffix} is {list(shape_of(t))}, expected [K/G, N] = "
                                 f"[{k // g}, {n}]", suffix))
    out.extend(_group_rules(k, fields, tensors))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in ("F32", "F16", "BF16") or shape_of(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(shape_of(b))}, expected a float "
                             f"[{n}]", "bias"))
    return out


def _grouped(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    g = _group(f, k)
    return [(k // g, n)] if g else []


class AWQW4A16Reading(ReadingFacet):
    """awq_w4a16: how a layer reads (its description)."""

    def describe(self, fields):
        return f"{NAME} G={(fields or {}).get('group_size', 64)}"


class AWQW4A16Planning(PlanningFacet):
    """awq_w4a16: what convert plans for it."""

    def marker(self, target, group_size):
        return {"format": NAME, "group_size": 64}

    def same_target(self, layer, fields, marker):
        return fields["format"] == NAME and fields.get("group_size") == marker.get("group_size")

    def planned(self, n, k, marker):
        g = marker.get("group_size", 64)
        return {"weight": ("I8", (n, k // 2)), "weight_scale": ("BF16", (k // g, n)),
                "weight_zeros": ("BF16", (k // g, n))}


class AWQW4A16Rules(RulesFacet):
    """awq_w4a16: its header rules."""

    def layer_violations(self, fields, tensors):
        return rules(fields, tensors)

    def skip_shape(self, suffix, layer):
        w = layer.weight
        return suffix in ("weight_scale", "weight_zeros") and (
            w is None or _group(layer.fields or {}, 2 * w.shape[1]) is None)

    def extra_findings(self, layer, add):
        w = layer.weight
        if w is None or len(w.shape) != 2:
            return
        for v in _group_rules(2 * w.shape[1], layer.fields or {}, layer.tensors):
            add(v.code, v.message, v.suffix)


SPEC = FormatSpec(
    name=NAME,
    description="AWQ: unsigned int4 codes (two per byte) + fp16/bf16 group scales and zero points",
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k // 2)],
                       "[N, K/2] (two unsigned 4-bit codes per byte, even column low)"),
            TensorSpec("weight_scale", SCALE_DTYPES, _grouped, "[K/G, N]"),
            TensorSpec("weight_zeros", SCALE_DTYPES, _grouped, "[K/G, N] (the weight_scale's dtype)"),
            BIAS,
        ),
        marker_defaults={"group_size": 64},
        packed=True,
    ),
    encoding=EncodingFacet(
        targets=(Target("awq-w4a16", NAME, False,
                        "AWQ W4A16 (needs calibration statistics; refused without them)"),),
        chunked=False,  # written whole: its scales are stored [K/G, N], not by row
        unrowed_outputs=("weight_scale", "weight_zeros"),
        write_refusal=REFUSAL,
        calibrates=True,
        scales_channels=True,  # channel_scale: AWQ's per-input-channel scaling
        sampled_by_column=("weight_scale", "weight_zeros"),  # report samples: their rows, [n, K/G]
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts(
            "TensorCoreAWQW4A16Layout", None, "0.2.9",
            notes=(("ampere", "", "sm_80+ runs comfy-kitchen's CUDA gemv_awq_w4a16; other devices its "
                                  "pure-PyTorch path"),)),
        tensors=("weight", "weight_scale", "weight_zeros"),
        required=("weight", "weight_scale", "weight_zeros"),
        decodes=True,  # the runtime runs it through decode_weight (kitchen's W4A16 math)
        # ComfyUI's linear on an awq_w4a16 weight calls comfy-kitchen's gemv_awq_w4a16, whose
        # eager path (every device but CUDA / ROCm, where kitchen has AWQ kernels) computes in
        # the scales' dtype whatever the activations' dtype: the runtime runs the same computation
        # there (in bf16 activations it equals the dequantized matmul bit for bit).
        emulation=("comfy-kitchen gemv_awq_w4a16 (eager, in the scales' dtype)",
                   ("cpu", "mps", "xpu", "npu")),
    ),
    verify=VerifyFacet(
        # measured on tiny synthetic files calibrated on their own statistics (4 seeds, 4 blocks):
        # per-layer error on verify's random inputs 0.18-0.29 unscaled, up to 0.50 for a layer
        # carrying AWQ channel scaling (alone it differs from its float layer by the scale); block
        # SQNR 6.4-15.2 dB, whole model 9.9-15.8 dB (docs/calibration.md)
        limits=VerifyLimits(rel_err=0.5, block_sqnr_db=5.0),
        deep_scales=("weight_scale",),
        weight_bits=4,
    ),
    reading=AWQW4A16Reading(),
    planning=AWQW4A16Planning(),
    rules=AWQW4A16Rules(),
)
