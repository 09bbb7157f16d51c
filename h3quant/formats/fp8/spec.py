"""What an fp8 layer (``float8_e4m3fn`` / ``float8_e5m2``) stores, as data (torch-free).

Facts (docs/FORMATS.md, "fp8"): comfy-kitchen ``tensor/fp8.py`` (``TensorCoreFP8Layout``:
``state_dict_tensors`` gives ``weight`` and ``weight_scale``; the scale is one fp32 value) and
ComfyUI ``comfy/ops.py`` (``MixedPrecisionOps.Linear._load_from_state_dict`` reads
``weight_scale`` for both fp8 formats and registers ``input_scale`` when present) and
``comfy/quant_ops.py`` (``QUANT_ALGOS``: storage dtype, parameters).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorDecl:
    """One tensor of a layer: suffix, accepted safetensors dtypes (the first is written),
    shape text in terms of the logical [N, K], required or optional."""

    suffix: str
    dtypes: tuple[str, ...]
    shape: str
    required: bool = True


@dataclass(frozen=True)
class Fp8Spec:
    name: str  # the marker's ``format``
    target: str  # ``convert --to`` name
    code_dtype: str  # safetensors dtype of the codes
    torch_dtype: str  # torch dtype name of the codes
    max_value: float  # the largest finite code
    mantissa_bits: int
    tensors: tuple[TensorDecl, ...]
    marker_defaults: tuple[tuple[str, object], ...]
    bits_per_weight: float
    # verify limits: per-layer output relative L2 against the float layer, and a block's SQNR.
    # Measured on the tiny synthetic H3 (outlier input channels): e4m3 layers 0.027, blocks
    # 17-19 dB; e5m2 layers 0.054, blocks 17 dB (int8 ConvRot: 0.010, 29 dB). See FORMATS.md.
    verify_rel_err: float
    verify_block_sqnr_db: float
    help: str


def _tensors(code_dtype: str) -> tuple[TensorDecl, ...]:
    return (
        TensorDecl("weight", (code_dtype,), "[N, K]"),
        TensorDecl("weight_scale", ("F32",), "[] (one value; [1], [N] or [N, 1] also read)"),
        TensorDecl("input_scale", ("F32",), "[]", required=False),
        TensorDecl("bias", ("BF16", "F16", "F32"), "[N]", required=False),
    )


E4M3 = Fp8Spec(
    name="float8_e4m3fn", target="fp8", code_dtype="F8_E4M3", torch_dtype="float8_e4m3fn",
    max_value=448.0, mantissa_bits=3, tensors=_tensors("F8_E4M3"),
    marker_defaults=(("full_precision_matrix_mult", False),), bits_per_weight=8.0,
    verify_rel_err=0.06, verify_block_sqnr_db=15.0,
    help="fp8 e4m3 codes with one fp32 scale per tensor (ComfyUI's float8_e4m3fn)",
)
E5M2 = Fp8Spec(
    name="float8_e5m2", target="fp8-e5m2", code_dtype="F8_E5M2", torch_dtype="float8_e5m2",
    max_value=57344.0, mantissa_bits=2, tensors=_tensors("F8_E5M2"),
    marker_defaults=(("full_precision_matrix_mult", False),), bits_per_weight=8.0,
    verify_rel_err=0.12, verify_block_sqnr_db=13.0,
    help="fp8 e5m2 codes with one fp32 scale per tensor (ComfyUI's float8_e5m2)",
)
SPECS = (E4M3, E5M2)

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
