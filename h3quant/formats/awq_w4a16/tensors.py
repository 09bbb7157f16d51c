"""AWQ W4A16 (``awq_w4a16``) tensor work: decode only (writing needs calibration statistics).

The layout (comfy-kitchen 0.2.40 ``tensor/awq_w4a16.py``; docs/FORMATS.md, awq_w4a16):

- ``weight``: int8 ``[N, K/2]``, two unsigned 4-bit codes in [0, 15] per byte, the even column in
  the low nibble;
- ``weight_scale``: fp16 / bf16 ``[K/G, N]``, one scale per group of ``G`` input columns and row;
- ``weight_zeros``: same dtype and shape, a float zero point per group.

``W[n, k] = (q[n, k] - 8) * weight_scale[k // G, n] + weight_zeros[k // G, n]``, computed in
``dtype`` (the scales' dtype reproduces comfy-kitchen's dequantize; fp32 is exact).
"""

from __future__ import annotations

import torch

DEFAULT_GROUP = 64
OFFSET = 8


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` bytes -> ``[R, 2C]`` codes in [0, 15], the even column from the low nibble."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    out = torch.empty((b.shape[0], b.shape[1] * 2), dtype=torch.uint8, device=b.device)
    out[:, 0::2] = b & 0x0F
    out[:, 1::2] = b >> 4
    return out


def decode_awq(q: torch.Tensor, scale_rows: torch.Tensor, zero_rows: torch.Tensor, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R, K]`` weight rows from packed ``q`` ``[R, K/2]`` and their scales and zeros given
    row-major (``[R, K/G]``, i.e. the stored ``[K/G, N]`` columns of those rows)."""
    r, k = q.shape[0], q.shape[1] * 2
    codes = unpack_uint4(q).to(dtype).reshape(r, k // group, group)
    s = scale_rows.to(dtype).reshape(r, k // group, 1)
    z = zero_rows.to(dtype).reshape(r, k // group, 1)
    return ((codes - float(OFFSET)) * s + z).reshape(r, k)


def awq_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
               group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` as comfy-kitchen's ``gemv_awq_w4a16`` computes it (its eager path, the one
    ComfyUI's linear reaches on these devices): the weight decoded in the scales' dtype, ``x``
    cast to that dtype, the product in it, then the bias added (torch's promotion, as kitchen).
    The result is returned in ``x.dtype``: for an fp32 model with bf16 scales, the values of
    kitchen's bf16 product exactly, not an fp32 product."""
    compute = scale.dtype
    w = decode_awq(q, scale.t(), zeros.t(), group, dtype=compute)
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.to(compute) @ w.t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
