"""INT4 ConvRot with calibrated rounding: the rotation and row scales of rounding to nearest,
int4 codes by error feedback.

``encode_int4_convrot`` runs first and fixes the per-row scale ``s = max|W_rot| / 7`` (in the
weight's dtype, as comfy-kitchen's quantizer computes it). The weight is rotated the same way
(each block of ``g`` columns times ``H_g``, in the weight's dtype), and
``calibration.feedback`` (``h3quant.calibration``) walks the rotated columns with the Hessian in
the same ConvRot basis (``R^T H R``, the basis INT8 ConvRot and W4A8 use too), choosing each
code as ``clamp(round_half_even(v / s), -7, 7)`` (the division in the weight's dtype, as the
encoder does it) after the error of the columns before it was fed forward. Codes stay in
[-7, 7]. Statistics that give no feedback (an identity Hessian) leave every value as it was, so
they reproduce the uncalibrated bytes exactly.
"""

from __future__ import annotations

import torch

from h3quant.formats.int4_convrot.tensors import (CHUNK_ELEMS, INT4_MAX, encode_int4_convrot,
                                                  pack_int4, rotate)


def rotated(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` in the ConvRot basis, fp32, computed as the encoder computes it: in ``w``'s dtype,
    a matmul per block of ``g`` columns with the transposed view of ``H_g``, in the same row
    chunks (so the rounding of a bf16 weight is the encoder's)."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.float32)
    step = max(1, CHUNK_ELEMS // max(k, 1))
    for r0 in range(0, n, step):
        out[r0:r0 + step] = rotate(w[r0:r0 + step], group_size)
    return out


def encode_int4_convrot_calibrated(w: torch.Tensor, calibration, group_size: int = 256
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 ``[N, K/2]``, fp32 scales ``[N]``): ``encode_int4_convrot``'s scales, codes
    chosen by ``calibration.feedback(x, quantize, convrot=True, group_size=)``."""
    _, s = encode_int4_convrot(w, group_size)  # checks the weight and K; fixes the scales
    dtype = w.dtype
    s_w = s.to(dtype)  # exact: the encoder computed s in w's dtype
    s32 = s.reshape(-1)

    def quantize(v: torch.Tensor, j: int):
        c = (v.to(dtype) / s_w).round_().clamp_(-INT4_MAX, INT4_MAX).to(torch.float32)
        return c, c * s32

    codes = calibration.feedback(rotated(w, group_size), quantize, convrot=True,
                                 group_size=group_size)
    return pack_int4(codes.to(torch.int8)), s


__all__ = ["encode_int4_convrot_calibrated", "rotated"]
