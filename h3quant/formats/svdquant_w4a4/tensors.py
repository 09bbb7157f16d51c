"""SVDQuant W4A4 (``svdquant_w4a4``) tensor work: decode only (the format is written from
SVDQuant calibration, which h3quant does not do).

The layout (comfy-kitchen 0.2.40 ``tensor/svdquant_w4a4.py``, natural row-major storage;
docs/FORMATS.md, svdquant_w4a4): ``weight`` int8 ``[N, K/2]`` (two signed 4-bit codes per byte,
the even column in the low nibble), ``weight_scale`` ``[K/64, N]``, and three float tensors:
the low-rank factors ``proj_down`` ``[K, R]`` and ``proj_up`` ``[N, R]`` and the input
smoothing ``smooth_factor`` ``[K]``.

kitchen's ``dequantize`` runs its own eager linear on an identity input (in the model's
dtype): each identity row, divided by ``smooth_factor``, is quantized per group of 64 to int4
(one non-zero value per row, so its code is +-7 at scale ``|1 / smooth| / 7``), multiplied by
the dequantized weight ``q * weight_scale`` in the scales' dtype, and the low-rank branch
``proj_down @ proj_up^T`` (fp32, then the scales' dtype) is added. ``decode_svdquant`` computes
the same values with the same torch operations on the diagonal alone, without the ``K x K``
identity: bit-identical to kitchen's result (tests/formats/svdquant_w4a4/test_format_svdquant.py).
"""

from __future__ import annotations

import torch

GROUP = 64  # the int4 kernel's group along K (activations and weights)
INT4_MAX = 7  # kitchen's activation quantizer emits codes in [-7, 7]
ABSMAX_FLOOR = 1e-10  # kitchen's clamp on a group's absolute maximum


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` bytes -> ``[R, 2C]`` signed codes in [-8, 7], the even column from the low
    nibble."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0x0F, b >> 4
    out = torch.stack([lo, hi], dim=-1).reshape(b.shape[0], -1)
    return torch.where(out >= 8, out - 16, out).to(torch.int8)


def identity_activation(smooth: torch.Tensor, x_dtype: torch.dtype,
                        compute: torch.dtype) -> torch.Tensor:
    """``[K]``: the dequantized activation kitchen's quantizer gives row ``i`` of the identity
    at column ``i`` (every other column is 0), in ``compute``."""
    k = smooth.shape[0]
    x = torch.ones(k, dtype=x_dtype) / smooth  # the diagonal of eye / smooth
    scale = x.abs().clamp(min=ABSMAX_FLOOR) / INT4_MAX  # the group's absmax is |x_i| alone
    q = (x / scale).round().clamp(-INT4_MAX, INT4_MAX).to(torch.int8)
    return q.to(compute) * scale.to(x_dtype)


def lowrank(proj_down: torch.Tensor, proj_up: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """``[N, K]``: the low-rank branch ``proj_down @ proj_up^T`` of every row as kitchen adds
    it (one fp32 matmul of the whole layer, then ``compute``). Computed for the whole layer
    at once: a matmul over fewer rows may sum in another order."""
    return (proj_down.float() @ proj_up.float().t()).t().to(compute)


def decode_svdquant(q: torch.Tensor, scale_rows: torch.Tensor, lowrank_rows: torch.Tensor,
                    smooth: torch.Tensor, x_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``[r, K]`` of kitchen's dequantized weight, in the scales' dtype.

    ``q``: packed rows ``[r, K/2]``; ``scale_rows``: their scales row-major ``[r, K/64]`` (the
    stored ``[K/64, N]`` columns of those rows); ``lowrank_rows``: their rows of ``lowrank``;
    ``smooth`` ``[K]``. ``x_dtype``: the identity input's dtype (the model's; default the
    scales' dtype)."""
    compute = scale_rows.dtype
    x_dtype = x_dtype or compute
    r, k = q.shape[0], q.shape[1] * 2
    act = identity_activation(smooth, x_dtype, compute)  # [K]
    codes = unpack_int4(q).to(compute).reshape(r, k // GROUP, GROUP)
    w = (codes * scale_rows.unsqueeze(-1)).reshape(r, k)  # kitchen's wgt_fp, in compute
    # x @ w^T with one non-zero term per output: the product rounded once to compute
    main = (act.float() * w.float()).to(compute)
    return main + lowrank_rows.to(compute)


def decode_layer(q: torch.Tensor, scale: torch.Tensor, proj_down: torch.Tensor,
                 proj_up: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """The whole ``[N, K]`` dequantized weight from the stored tensors (``scale`` as stored,
    ``[K/64, N]``), in the scales' dtype: kitchen's ``dequantize``."""
    return decode_svdquant(q, scale.t(), lowrank(proj_down, proj_up, scale.dtype), smooth)


__all__ = ["GROUP", "decode_layer", "decode_svdquant", "identity_activation", "lowrank",
           "unpack_int4"]
