"""What an fp8 layer (``float8_e4m3fn`` / ``float8_e5m2``) stores, as data (torch-free).

Facts (docs/FORMATS.md 17): comfy-kitchen ``tensor/fp8.py`` (``TensorCoreFP8Layout``:
``state_dict_tensors`` gives ``weight`` and ``weight_scale``; the scale is one fp32 value) and
ComfyUI ``comfy/ops.py`` (``MixedPrecisionOps.Linear._load_from_state_dict`` reads
``weight_scale`` for both fp8 formats and registers ``input_scale`` when present),
``comfy/quant_ops.py`` (``QUANT_ALGOS``) and ``comfy/utils.py`` (``convert_old_quants``: the
legacy ``scaled_fp8`` marker).
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.formats.fp8 import rules
from h3quant.formats.spec import FormatSpec, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import BIAS, Target, TensorSpec, VerifyLimits, scalar
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("D130", "fp8-code-nonfinite", Severity.ERROR,
         "fp8 codes decode to finite values (no NaN / inf codes)")

# ComfyUI's legacy scaled-fp8 checkpoints (comfy/utils.py ``convert_old_quants``): a tensor
# named ``scaled_fp8`` (under the model prefix) marks the file; each fp8 layer then carries
# ``scale_weight`` (read as ``weight_scale``, format float8_e4m3fn) and may carry
# ``scale_input`` (read as ``input_scale``; dropped when it is 1.0). The marker's dtype is the
# fp8 dtype (F32 reads as e4m3); two elements mean ``full_precision_matrix_mult``. ComfyUI's
# own writer stores it as an empty fp8 tensor.
SCALED_FP8_MARKER = "scaled_fp8"
SCALED_FP8_MARKER_DTYPE = "F8_E4M3"
LEGACY_WEIGHT_SCALE = "scale_weight"
LEGACY_INPUT_SCALE = "scale_input"


def _scale_shapes(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return [(), (1,), (n,), (n, 1)]


@dataclass(frozen=True)
class Fp8Codes:
    """The codes of a per-tensor-scaled fp8 format, held by its planning facet (``codes_of``):
    its planner and its codec read them."""

    code_dtype: str = "F8_E4M3"  # safetensors dtype of the codes
    torch_dtype: str = "float8_e4m3fn"
    max_value: float = 448.0  # the largest finite code


class Fp8Planning(PlanningFacet):
    """A per-tensor-scaled fp8 format: what convert plans for it, with its ``codes``."""

    def __init__(self, codes: Fp8Codes) -> None:
        self.codes = codes

    @property
    def code_dtype(self) -> str:
        return self.codes.code_dtype

    def marker(self, target, group_size):
        return {"format": self.spec.name}

    def same_target(self, layer, fields, marker):
        s = layer.tensors.get("weight_scale")
        return fields["format"] == self.spec.name and s is not None and s.numel == 1

    def planned(self, n, k, marker):
        return {"weight": (self.code_dtype, (n, k)), "weight_scale": ("F32", ())}

    def kept_marker(self, code_dtype):
        return self.marker(None, 0) if code_dtype == self.code_dtype else None


class Fp8Rules(RulesFacet):
    """A per-tensor-scaled fp8 format: its header rules."""

    def tensor_violations(self, n, cols, fields, tensors):
        return n, cols, rules.fp8_violations(self.spec.name, tensors)


def _spec(name: str, target: str, code_dtype: str, max_value: float, limits: VerifyLimits,
          text: str) -> FormatSpec:
    return FormatSpec(
        name=name, description=text,
        storage=StorageFacet(
            tensors=(
                TensorSpec("weight", (code_dtype,), lambda n, k, f: [(n, k)], "[N, K]"),
                TensorSpec("weight_scale", ("F32",), _scale_shapes, "[] (or [1], [N], [N, 1])"),
                TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
                BIAS,
            ),
            marker_defaults={"full_precision_matrix_mult": False},
        ),
        encoding=EncodingFacet(
            targets=(Target(target, name, False, text),),
            chunked=False,  # one amax over the whole layer: a first pass, then row chunks
            streamed=True,
            unrowed_outputs=("weight_scale",),
            scans=True,
        ),
        runtime=RuntimeFacet(
            kitchen=KitchenFacts("TensorCoreFP8Layout", (8, 9), "0.2.0"),
            tensors=("weight", "weight_scale", "input_scale"),
            required=("weight", "weight_scale"),
            decodes=True,  # the runtime runs it through its float decode
            kernel=("fp8 scaled_mm (comfy-kitchen TensorCoreFP8Layout)", (8, 9)),  # ComfyUI, CUDA
        ),
        verify=VerifyFacet(
            limits=limits,
            deep_scales=("weight_scale", "input_scale"),
            weight_bits=8,
            whole_model=True,
        ),
        planning=Fp8Planning(Fp8Codes(code_dtype=code_dtype, torch_dtype=name, max_value=max_value)),
        rules=Fp8Rules(),
    )


# verify limits: per-layer output relative L2 against the float layer, and a block's SQNR.
# Measured on the tiny synthetic H3 (outlier input channels): e4m3 layers 0.027, blocks
# 17-19 dB; e5m2 layers 0.054, blocks 17 dB (int8 ConvRot: 0.010, 29 dB). FORMATS.md 17.4.
E4M3 = _spec("float8_e4m3fn", "fp8", "F8_E4M3", 448.0, VerifyLimits(0.06, 15.0),
             "fp8 e4m3 codes with one fp32 scale per tensor (ComfyUI's float8_e4m3fn)")
E5M2 = _spec("float8_e5m2", "fp8-e5m2", "F8_E5M2", 57344.0, VerifyLimits(0.12, 13.0),
             "fp8 e5m2 codes with one fp32 scale per tensor (ComfyUI's float8_e5m2)")
SPECS = (E4M3, E5M2)
SPEC = E4M3


def codes_of(spec: FormatSpec) -> Fp8Codes:
    """The fp8 codes of ``spec``, one of ``SPECS``."""
    assert isinstance(spec.planning, Fp8Planning), spec.name
    return spec.planning.codes

