"""Formats ComfyUI knows that h3quant has no codec for yet: their specs only (FORMATS.md 2-4).

validate checks their tensor sets (finding Q105 says h3quant cannot convert or run them);
convert and verify refuse them. A format that gets its own package (spec and codec) leaves this
list. Torch-free.
"""

from __future__ import annotations

from h3quant.formats.spec import BIAS, FormatSpec, TensorSpec, scalar


def _int8_scale(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return [(n, 1), (), (n,), (1,)]


def _fp8(name: str, dtype: str, kind: str) -> FormatSpec:
    return FormatSpec(
        name=name, description=f"fp8 {kind} weight with an fp32 tensor scale",
        tensors=(
            TensorSpec("weight", (dtype,), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", ("F32",), _int8_scale, "[] (or per row)"),
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
            BIAS,
        ),
    )


SPECS: tuple[FormatSpec, ...] = (
    FormatSpec(
        name="convrot_w4a4", description="ConvRot 4-bit weights and activations",
        tensors=(TensorSpec("weight", ("I8", "U8"), None, "packed"),), closed=False, opaque=True,
    ),
    _fp8("float8_e4m3fn", "F8_E4M3", "e4m3"),
    _fp8("float8_e5m2", "F8_E5M2", "e5m2"),
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
        name="mxfp8", description="fp8 e4m3 weight + e8m0 block scales (32)",
        tensors=(
            TensorSpec("weight", ("F8_E4M3",), lambda n, k, f: [(n, k)], "[N, K]"),
            TensorSpec("weight_scale", ("U8", "F8_E8M0"), lambda n, k, f: [(n, -(-k // 32))],
                       "[N, K/32] (may be padded)", at_least=True),
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
            BIAS,
        ),
    ),
    FormatSpec(
        name="awq_w4a16", description="AWQ 4-bit weights, 16-bit activations",
        tensors=(TensorSpec("weight", ("I8", "U8", "I32"), None, "packed"),), closed=False,
        opaque=True,
    ),
)
