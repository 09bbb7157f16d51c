"""Shared int8 linear math (FORMATS.md 3.2, 3.3): input activation, activation quantization,
scale application and weight dequantization. Every backend builds on these; nothing here picks a
device or a kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3quant.convrot import rotate
from h3quant.errors import FormatError, UnsupportedError
from h3quant.formats.int8.tensors import quantize_activation as quantize_rows

INPUT_ACTS = (None, "none", "swiglu")
# Largest fp32 temporary (bytes) materialised at once when scaling int32 accumulators.
_SCALE_CHUNK_BYTES = 256 * 1024 * 1024


def input_act_width(input_act: str | None) -> int:
    """Input columns per activated column: 2 for swiglu ([gate | up]), else 1."""
    check_input_act(input_act)
    return 2 if input_act == "swiglu" else 1


def check_input_act(input_act: str | None) -> None:
    if input_act not in INPUT_ACTS:
        raise UnsupportedError(f"unsupported input_act {input_act!r} (supported: None, 'swiglu')")


def apply_input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    """The fused input activation, applied eagerly in the activation dtype.

    ``swiglu``: ``x = [gate | up]`` (two contiguous halves of the last dim) -> ``silu(gate) * up``.
    Computed in ``x.dtype`` so that ``forward(x, input_act="swiglu")`` equals
    ``forward(silu(gate) * up)`` bit for bit on every backend.
    """
    check_input_act(input_act)
    if input_act in (None, "none"):
        return x
    width = x.shape[-1]
    if width % 2:
        raise FormatError(f"swiglu input width must be even ([gate | up] halves), got {width}")
    gate, up = x.split(width // 2, dim=-1)
    return F.silu(gate) * up


def row_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Weight scales as a flat fp32 vector of 1 or ``n`` values (from ``[N, 1]``, ``[N]`` or ``[]``)."""
    flat = scale.reshape(-1)
    if flat.numel() not in (1, n):
        raise FormatError(f"weight scale must hold 1 or {n} values, got shape {tuple(scale.shape)}")
    return flat


def rotate_activation(x: torch.Tensor, convrot: bool, group_size: int) -> torch.Tensor:
    """fp32 activation, ConvRot-rotated along the last dim when ``convrot``."""
    return rotate(x, group_size) if convrot else x.to(torch.float32)


def quantize_activation(
    x: torch.Tensor, convrot: bool, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (fp32), flatten to ``[M, K]`` and quantize per row: ``(q_x int8, s_x fp32 [M])``."""
    xr = rotate_activation(x, convrot, group_size)
    return quantize_rows(xr.reshape(-1, xr.shape[-1]))


def scale_accumulator(
    acc: torch.Tensor, s_x: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(acc.float() * s_x[:, None] * s[None, :]).to(out_dtype)``: each scale applied once.

    Done in row chunks so the fp32 temporary stays under ~256 MiB; the result is identical.
    """
    m, n = acc.shape
    s_row = s.to(torch.float32).reshape(1, -1)
    s_col = s_x.to(torch.float32).reshape(-1, 1)
    rows = max(1, min(m, _SCALE_CHUNK_BYTES // max(1, 4 * n)))
    if rows >= m:
        return (acc.to(torch.float32) * s_col * s_row).to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    for i in range(0, m, rows):
        j = min(m, i + rows)
        out[i:j] = (acc[i:j].to(torch.float32) * s_col[i:j] * s_row).to(out_dtype)
    return out


def dequantize_weight(
    q: torch.Tensor, s: torch.Tensor, convrot: bool, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``W = (q.float() * s) @ H_g`` per block (H_g is its own inverse), cast to ``dtype``.

    Runs on ``q``'s device; ``s`` is the flat vector from ``row_scales``.
    """
    w = q.to(torch.float32) * s.to(torch.float32).reshape(-1, 1)
    if convrot:
        w = rotate(w, group_size)
    return w.to(dtype)


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(dtype=y.dtype)
