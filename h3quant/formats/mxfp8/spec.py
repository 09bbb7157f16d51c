"""What an ``mxfp8`` layer stores, as data (torch-free).

Facts (docs/FORMATS.md, "mxfp8"): comfy-kitchen ``tensor/mxfp8.py`` (``TensorCoreMXFP8Layout``:
``weight`` e4m3, ``weight_scale`` e8m0 per block of 32 along K in cuBLAS's blocked layout;
``get_padded_shape`` rounds both weight dims up to 32) and ``backends/eager/quantization.py``
(``quantize_mxfp8``; ``to_blocked`` pads the [N, K/32] scales to [roundup(N, 128),
roundup(K/32, 4)]); ComfyUI ``comfy/ops.py`` reads ``weight_scale`` as uint8 bytes viewed as
``float8_e8m0fnu``.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.formats.fp8.spec import TensorDecl

NAME = "mxfp8"
TARGET = "mxfp8"
BLOCK = 32
TILE = (128, 4)  # the scales' blocked tile (rows, scale columns)


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """The stored shape of the block scales of an [N, K] weight (K a multiple of 32)."""
    return roundup(n, TILE[0]), roundup(k // BLOCK, TILE[1])


@dataclass(frozen=True)
class MxSpec:
    name: str
    target: str
    tensors: tuple[TensorDecl, ...]
    bits_per_weight: float
    verify_rel_err: float
    verify_block_sqnr_db: float
    help: str


SPEC = MxSpec(
    name=NAME, target=TARGET,
    tensors=(
        TensorDecl("weight", ("F8_E4M3",), "[N, K], N and K multiples of 32"),
        TensorDecl("weight_scale", ("F8_E8M0", "U8"),
                   "[roundup(N, 128), roundup(K/32, 4)] (blocked 128x4 tiles)"),
        TensorDecl("input_scale", ("F32",), "[]", required=False),
        TensorDecl("bias", ("BF16", "F16", "F32"), "[N]", required=False),
    ),
    bits_per_weight=8.25,
    verify_rel_err=0.06, verify_block_sqnr_db=16.0,  # tiny synthetic: 0.027, blocks 19-21 dB
    help="fp8 e4m3 codes with an e8m0 (power-of-two) scale per 32 values (ComfyUI's mxfp8)",
)
