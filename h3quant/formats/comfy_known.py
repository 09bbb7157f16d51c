"""Formats ComfyUI knows that h3quant has no codec for yet: their specs only (FORMATS.md 2-4).

validate checks their tensor sets (finding Q105 says h3quant cannot convert or run them);
convert and verify refuse them. A format that gets its own package (spec and codec) leaves this
list. Torch-free.
"""

from __future__ import annotations

from h3quant.formats.spec import BIAS, FormatSpec, TensorSpec, scalar


SPECS: tuple[FormatSpec, ...] = (
    FormatSpec(
        name="convrot_w4a4", description="ConvRot 4-bit weights and activations",
        tensors=(TensorSpec("weight", ("I8", "U8"), None, "packed"),), closed=False, opaque=True,
    ),
    FormatSpec(
        name="nvfp4",
        description="fp4 e2m1 codes (two per byte) + e4m3 block scales (16) + fp32 tensor scale",
        tensors=(
            TensorSpec("weight", ("U8",), lambda n, k, f: [(n, k // 2)], "[N, K/2]"),
            TensorSpec("weight_scale", ("F8_E4M3",), lambda n, k, f: [(n, -(-k // 16))],
                       "[N, K/16] (may be padded)", at_least=True),
            TensorSpec("weight_scale_2", ("F32",), scalar, "[]"),
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
            BIAS,
        ),
        packed=True,
    ),
    FormatSpec(
        name="awq_w4a16", description="AWQ 4-bit weights, 16-bit activations",
        tensors=(TensorSpec("weight", ("I8", "U8", "I32"), None, "packed"),), closed=False,
        opaque=True,
    ),
)
