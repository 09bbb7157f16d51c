"""``int8_tensorwise``: int8 weight [N, K] with per-row (or one) fp32 scale, optionally ConvRot."""

from __future__ import annotations

from h3quant.convrot import check_group_size
from h3quant.formats.spec import FormatSpec, ReadingFacet, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RelayoutFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (
    BIAS,
    SCALE_DTYPES,
    TensorSpec,
    Target,
    VerifyLimits,
    Violation,
    scalar,
    shape_of,
)

NAME = "int8_tensorwise"


def int8_scale_shapes(n: int) -> list[tuple[int, ...]]:
    return [(n, 1), (), (n,), (1,)]


def int8_marker(convrot: bool = True, group_size: int = 256) -> dict:
    """The canonical ``.comfy_quant`` dict h3quant writes (key order is part of the bytes).
    Torch-free: ``convert`` plans (and starts writing) before torch is loaded."""
    if not convrot:
        return {"format": NAME}
    check_group_size(group_size)
    return {"format": NAME, "convrot": True, "convrot_groupsize": int(group_size)}


class Int8Reading(ReadingFacet):
    """int8_tensorwise: how a layer reads (its description)."""

    def describe(self, fields):
        if fields and fields.get("convrot"):
            return f"{self.spec.name} convrot g={fields.get('convrot_groupsize', 256)}"
        return self.spec.name


class Int8Planning(PlanningFacet):
    """int8_tensorwise: what convert plans for it."""

    def marker(self, target, group_size):
        return int8_marker(convrot=target.convrot, group_size=group_size)

    def same_target(self, layer, fields, marker):
        convrot = bool(marker.get("convrot"))
        return (fields["format"] == self.spec.name and bool(fields.get("convrot")) == convrot
                and (not convrot or fields.get("convrot_groupsize") == marker["convrot_groupsize"])
                and layer.tensors["weight_scale"].numel == layer.weight.shape[0])

    def skip_reason(self, k, marker):
        g = marker.get("convrot_groupsize")
        if marker.get("convrot") and k % g:
            return f"K={k} is not divisible by the group size {g}"
        return None

    def planned(self, n, k, marker):
        return {"weight": ("I8", (n, k)), "weight_scale": ("F32", (n, 1))}

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix == "weight" and dtype == "U8":
            dtype = "I8"
        if suffix == "weight_scale":
            shape = (n, 1)
        return dtype, shape


class Int8Rules(RulesFacet):
    """int8_tensorwise: its header rules."""

    def tensor_violations(self, n, cols, fields, tensors):
        out: list[Violation] = []
        s = tensors.get("weight_scale")
        if s is None:
            out.append(Violation("Q101", f"{self.spec.name} layer has no weight_scale", "weight_scale"))
        else:
            if s.dtype not in SCALE_DTYPES:
                out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32",
                                     "weight_scale"))
            if shape_of(s) not in int8_scale_shapes(n):
                out.append(Violation("Q103", f"weight_scale shape {list(shape_of(s))} fits neither "
                                     f"[] nor [{n}] nor [{n}, 1]", "weight_scale"))
        return n, cols, out

    def combination_violations(self, fields, tensors):
        s = tensors.get("weight_scale")
        if fields.get("convrot") and s is not None and shape_of(s) in ((), (1,)):
            return [Violation("Q103", "ConvRot int8 layers need per-row scales ([N, 1] or "
                              f"[N]), got a single scale {list(shape_of(s))}", "weight_scale")]
        return []


RELAYOUT_NOTE = "pure relayout: same int8 codes and scales, transposed (no requantization)"

SPEC = FormatSpec(
    name=NAME,
    description="int8 weight with per-row (or tensorwise) fp32 scale, optional ConvRot",
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", SCALE_DTYPES, lambda n, k, f: int8_scale_shapes(n),
                       "[N, 1] (per row), [] (tensorwise) or [N]"),
            BIAS,
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
        ),
        marker_defaults={"convrot": False, "convrot_groupsize": 256},
        convrot_rules=True,
    ),
    encoding=EncodingFacet(
        targets=(
            Target("int8-convrot", NAME, True, "int8 with ConvRot rotation (per-row scales)"),
            Target("int8", NAME, False, "int8 without rotation (per-row scales)"),
        ),
        calibrates=True,
    ),
    relayout=RelayoutFacet(
        int8_codes=True,
        row_scale="weight_scale",
        relayout_note=RELAYOUT_NOTE,
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts(
            "TensorWiseINT8Layout", (7, 5), "0.2.11",
            notes=(("ascend", "unverified", "comfy-kitchen has an Ascend int8_linear (npu_quant_matmul "
                                            "on the [N, K] weight); whether ComfyUI reaches it is "
                                            "unverified"),)),
        tensors=("weight", "weight_scale"),
        required=("weight", "weight_scale"),
    ),
    verify=VerifyFacet(
        limits=VerifyLimits(rel_err=0.05, block_sqnr_db=20.0),
        deep_scales=("weight_scale", "input_scale"),
        weight_bits=8,
    ),
    reading=Int8Reading(),
    planning=Int8Planning(),
    rules=Int8Rules(),
)
