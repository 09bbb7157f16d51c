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
from h3quant.formats.spec import FormatSpec, ReadingFacet, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (packed_weight, BIAS, Target, TensorSpec, VerifyLimits, Violation,
                                  shape_of)
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q121", "int4-quant-group", Severity.ERROR,
         "convrot_w4a4: K is a multiple of the int4 kernel's group size "
         "64, and quant_group_size (when present) is 64")
register("Q122", "linear-dtype", Severity.ERROR,
         "convrot_w4a4: linear_dtype is 'int4' or 'int8'")
register("Q126", "format-alias", Severity.INFO,
         "int4_tensorwise is another name for convrot_w4a4 (a ComfyUI fork's): "
         "read as convrot_w4a4, written under that name")
register("Q127", "alias-unrotated", Severity.ERROR,
         "int4_tensorwise is read as convrot_w4a4 only when its marker "
         "says convrot: true (convrot_w4a4 always rotates)")
register("D122", "int4-range", Severity.WARNING,
         "signed int4 codes stay in [-7, 7] (-8 is legal but never produced)")

NAME = "convrot_w4a4"
# Another name for this layout: a ComfyUI fork maps ``int4_tensorwise`` to the convrot_w4a4
# layout (docs/FORMATS.md, int4_tensorwise). Read as convrot_w4a4, never written under it.
ALIAS = "int4_tensorwise"
QUANT_GROUP = 64
LINEAR_DTYPES = ("int4", "int8")
BITS_PER_WEIGHT = 4.0  # plus one fp32 scale per row


def marker(group_size: int = 256) -> dict:
    """The canonical marker h3quant writes (key order is part of the bytes)."""
    return {"format": NAME, "convrot_groupsize": int(group_size)}


def k_error(k: int, g) -> str | None:
    if not isinstance(g, int) or isinstance(g, bool) or not is_valid_group_size(g):
        return f"convrot_groupsize {g!r} is not a power of 4 (4, 16, 64, 256, 1024)"
    if k % g:
        return f"K={k} is not divisible by convrot_groupsize {g}"
    return None


def _kernel_errors(k: int, fields: dict) -> list[Violation]:
    out = []
    qg = fields.get("quant_group_size", QUANT_GROUP)
    if qg != QUANT_GROUP or k % QUANT_GROUP:
        out.append(Violation("Q121", f"the int4 kernel needs quant_group_size {QUANT_GROUP} and K "
                             f"divisible by it (quant_group_size {qg!r}, K={k})"))
    ld = fields.get("linear_dtype", "int4")
    if ld not in LINEAR_DTYPES:
        out.append(Violation("Q122", f"linear_dtype {ld!r} is neither 'int4' nor 'int8'"))
    return out


def rules(fields: dict, tensors: dict) -> list[Violation]:
    """Every header rule of one convrot_w4a4 layer (what convert and the runtime refuse by)."""
    out, logical = packed_weight("convrot_w4a4", tensors, "I8", "int4 codes", "[N, K/2]")
    if logical is None:
        return out
    n, k = logical
    s = tensors.get("weight_scale")
    if s is None:
        out.append(Violation("Q101", "convrot_w4a4 layer has no weight_scale (expected F32 [N])",
                             "weight_scale"))
    else:
        if s.dtype != "F32":
            out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32 [N]",
                                 "weight_scale"))
        if shape_of(s) not in ((n,), (n, 1)):
            out.append(Violation("Q103", f"weight_scale is {list(shape_of(s))}, expected [{n}] "
                                 "(one scale per row)", "weight_scale"))
    why = k_error(k, fields.get("convrot_groupsize", 256))
    if why:
        out.append(Violation("Q104", why))
    out.extend(_kernel_errors(k, fields))
    b = tensors.get("bias")
    if b is not None and (b.dtype not in ("F32", "F16", "BF16") or shape_of(b) != (n,)):
        out.append(Violation("Q103", f"bias is {b.dtype} {list(shape_of(b))}, expected a float "
                             f"[{n}]", "bias"))
    return out


class ConvRotW4A4Reading(ReadingFacet):
    """convrot_w4a4: how a layer reads (its description)."""

    def describe(self, fields):
        f = fields or {}
        text = f"{NAME} g={f.get('convrot_groupsize', 256)}"
        return text + (" linear=int8" if f.get("linear_dtype") == "int8" else "")


class ConvRotW4A4Planning(PlanningFacet):
    """convrot_w4a4: what convert plans for it."""

    def marker(self, target, group_size):
        return marker(group_size)

    def same_target(self, layer, fields, marker):
        return (fields["format"] in (NAME, ALIAS)
                and fields.get("convrot_groupsize") == marker["convrot_groupsize"]
                and fields.get("linear_dtype", "int4") == marker.get("linear_dtype", "int4"))

    def with_linear_dtype(self, marker, dtype):
        if dtype not in LINEAR_DTYPES:
            return None
        out = {key: v for key, v in marker.items() if key != "linear_dtype"}
        return out if dtype == "int4" else {**out, "linear_dtype": dtype}  # int4: the default

    def skip_reason(self, k, marker):
        why = k_error(k, marker["convrot_groupsize"])
        if why is None and k % QUANT_GROUP:
            why = f"K={k} is not divisible by the int4 kernel's group size {QUANT_GROUP}"
        return why

    def planned(self, n, k, marker):
        return {"weight": ("I8", (n, k // 2)), "weight_scale": ("F32", (n,))}

    def keep_declared(self, suffix, dtype, shape, n):
        return ("I8" if suffix == "weight" and dtype == "U8" else dtype), shape


class ConvRotW4A4Rules(RulesFacet):
    """convrot_w4a4: its header rules."""

    def layer_violations(self, fields, tensors):
        return rules(fields, tensors)

    def extra_findings(self, layer, add):
        w = layer.weight
        if w is None or len(w.shape) != 2:
            return
        for v in _kernel_errors(2 * w.shape[1], layer.fields or {}):
            add(v.code, v.message, v.suffix)


_EAGER = "ComfyUI runs comfy-kitchen's eager W4A4 (activations quantized to int4 too)"

# Sources: comfy-kitchen 0.2.40 backends/cuda convrot_w4a4_linear (the routes); NVIDIA's
# Ampere and Ada datasheets (dense int8 tensor-core rate half the int4 rate).
_A8_COST = ("int8 activations: the same bytes; on sm_80-sm_89 GPUs comfy-kitchen runs the "
            "int4-weight int8-activation GEMM instead of the int4 MMA (tensor cores at half the "
            "int4 rate, int8 activations read twice the bytes); Hopper and newer GPUs already "
            "run every INT4 ConvRot layer that way, and the CPU path ignores the field")

SPEC = FormatSpec(
    name=NAME,
    description="INT4 ConvRot: signed int4 codes (two per byte) + fp32 row scales, ConvRot always on",
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k // 2)],
                       "[N, K/2] (two signed 4-bit codes per byte, even column low)"),
            TensorSpec("weight_scale", ("F32",), lambda n, k, f: [(n,), (n, 1)],
                       "[N] (one scale per row)"),
            BIAS,
        ),
        marker_defaults={"convrot_groupsize": 256, "linear_dtype": "int4"},
        always_convrot=True,
        convrot_rules=True,
        packed=True,
    ),
    encoding=EncodingFacet(
        targets=(Target("int4-convrot", NAME, True,
                        "INT4 ConvRot (convrot_w4a4): signed int4, fp32 row scales, ConvRot"),),
        calibrates=True,
        linear_dtype_cost=_A8_COST,
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts(
            "TensorCoreConvRotW4A4Layout", (7, 5), "0.2.17",
            notes=(("hopper", "", "native int4 MMA on sm_8x only; Hopper and newer run comfy-kitchen's "
                                  "int8 fallback kernel"),
                   ("ascend", "unverified", "comfy-kitchen has an Ascend convrot_w4a4_linear; whether "
                                            "ComfyUI reaches it is unverified"),
                   ("cpu", "emulated", _EAGER), ("apple", "emulated", _EAGER))),
        tensors=("weight", "weight_scale"),
        required=("weight", "weight_scale"),
        decodes=True,  # the runtime may run it through decode_weight (dequantizing)
        kernel=("int4 MMA (comfy-kitchen TensorCoreConvRotW4A4Layout)", (7, 5)),
        # comfy-kitchen 0.2.40 implements convrot_w4a4_linear on these devices with its eager
        # backend only (its CUDA kernel needs sm_75, its Ascend one runs on NPUs): ComfyUI's forward
        # there quantizes the activations to int4 too, and the runtime runs the same computation.
        emulation=("comfy-kitchen eager W4A4 (activations quantized to int4)", ("cpu", "mps", "xpu")),
    ),
    verify=VerifyFacet(
        # verify runs ComfyUI's CPU forward (activations quantized to int4 too): on synthetic
        # checkpoints the worst layer reached 0.27 and the worst block 5.4 dB (bench/bench_int4_verify.py,
        # docs/benchmarks.md); a broken file (wrong scales, rotation, rows) is far beyond both
        limits=VerifyLimits(rel_err=0.35, block_sqnr_db=4.0),
        deep_scales=("weight_scale",),
        weight_bits=4,
    ),
    reading=ConvRotW4A4Reading(),
    planning=ConvRotW4A4Planning(),
    rules=ConvRotW4A4Rules(),
)


def alias_violations(fields: dict) -> list[Violation]:
    """An ``int4_tensorwise`` layer is read as convrot_w4a4 only when it is rotated."""
    if fields.get("convrot") is True:
        return []
    return [Violation("Q127", f"{ALIAS} layer without convrot: true; {NAME}, which this name is "
                      "read as, always rotates, so an unrotated layer would decode wrong")]


class AliasReading(ConvRotW4A4Reading):
    """``int4_tensorwise`` (convrot_w4a4 under another name): how a layer reads (its description)."""

    def describe(self, fields):
        return f"{ALIAS} (read as {super().describe(fields)})"


class AliasPlanning(ConvRotW4A4Planning):
    """``int4_tensorwise`` (convrot_w4a4 under another name): never written (no marker)."""

    def marker(self, target, group_size):
        return None  # never written under this name: no convert target names it


class AliasRules(ConvRotW4A4Rules):
    """``int4_tensorwise`` (convrot_w4a4 under another name): its header rules."""

    def layer_violations(self, fields, tensors):
        return rules(fields, tensors) + alias_violations(fields)

    def extra_findings(self, layer, add):
        super().extra_findings(layer, add)
        f = layer.fields or {}
        add("Q126", f"{ALIAS} is read as {NAME} g={f.get('convrot_groupsize', 256)}; stock "
            f"ComfyUI does not know the name {ALIAS}, and convert writes such a layer as {NAME}")
        for v in alias_violations(f):
            add(v.code, v.message, v.suffix)


ALIAS_SPEC = FormatSpec(
    name=ALIAS,
    description=f"another name for {NAME} (a ComfyUI fork's); read as {NAME}, never written",
    comfy=False,
    alias_of=NAME,
    storage=StorageFacet(
        tensors=SPEC.storage.tensors,
        marker_defaults=SPEC.storage.marker_defaults,
        always_convrot=True,
        convrot_rules=True,
        packed=True,
    ),
    encoding=EncodingFacet(
        calibrates=SPEC.encoding.calibrates,
    ),
    runtime=RuntimeFacet(
        tensors=SPEC.runtime.tensors,
        required=SPEC.runtime.required,
        decodes=SPEC.runtime.decodes,
        kernel=SPEC.runtime.kernel,
        emulation=SPEC.runtime.emulation,
    ),
    verify=VerifyFacet(
        limits=SPEC.verify.limits,
        deep_scales=SPEC.verify.deep_scales,
        weight_bits=4,
    ),
    reading=AliasReading(),
    planning=AliasPlanning(),
    rules=AliasRules(),
)
