"""nvfp4 with calibrated rounding: the scales of ``encode_nvfp4``, e2m1 codes by error feedback.

The uncalibrated encoder runs first and fixes everything but the codes: the fp32 tensor scale
``t`` (``weight_scale_2``) and every e4m3 block scale ``s`` (``weight_scale``), exactly as
rounding to nearest (comfy-kitchen's quantizer) chooses them. A weight of block ``b`` can then
take the values ``e * t * s_b`` for the 15 e2m1 values ``e`` in [-6, 6] (what comfy-kitchen's
dequantize computes), and ``calibration.feedback`` (``h3quant.calibration``) walks the columns
in the plain input basis, choosing each column's codes as the nearest such value (ties to even,
as the encoder rounds) after the error of the columns before it was fed forward. A block whose
scale is zero keeps code 0. Statistics that give no feedback (an identity Hessian) leave every
value as it was, so they reproduce the uncalibrated bytes exactly.
"""

from __future__ import annotations

import torch

from h3quant.formats.nvfp4.tensors import (BLOCK, E2M1_MAX, block_scales, e2m1_codes,
                                           encode_nvfp4, pack_hi_first, roundup)

# e2m1 value of each 4-bit code (bit 3: sign), the decoder's table
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_LUT = _VALUES + tuple(-v for v in _VALUES)


def encode_nvfp4_calibrated(w: torch.Tensor, calibration) -> dict[str, torch.Tensor]:
    """``encode_nvfp4``'s tensors with the e2m1 codes re-chosen by ``calibration``'s feedback
    (``calibration.feedback(x, quantize, convrot=False)``, the plain basis)."""
    out = encode_nvfp4(w)  # checks the weight; fixes the tensor and block scales
    n, k = w.shape
    np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
    t = out["weight_scale_2"].reshape(()).to(torch.float32)
    total = t * block_scales(out["weight_scale"], np_, kp // BLOCK)[:n]  # [n, Kp/16], fp32
    lut = torch.tensor(E2M1_LUT, dtype=torch.float32)

    def quantize(v: torch.Tensor, j: int):
        tot = total[:, j // BLOCK]
        zero = tot == 0
        x = v / torch.where(zero, torch.ones_like(tot), tot)  # the encoder's fp32 arithmetic
        x = torch.where(zero, torch.zeros_like(x), x).clamp_(-E2M1_MAX, E2M1_MAX)
        code = e2m1_codes(x)
        return code, lut[code.long()] * tot

    codes = calibration.feedback(w.to(torch.float32), quantize, convrot=False)
    full = torch.zeros((np_, kp), dtype=torch.uint8)  # padding rows and columns: code 0
    full[:n, :k] = codes
    out["weight"] = pack_hi_first(full)
    return out


__all__ = ["E2M1_LUT", "encode_nvfp4_calibrated"]
