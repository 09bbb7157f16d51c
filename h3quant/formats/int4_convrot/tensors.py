"""INT4 ConvRot (``convrot_w4a4``) tensor work: rotate, quantize per row to signed int4, pack.

The layout (docs/FORMATS.md, convrot_w4a4):

- ``weight``: int8 ``[N, K/2]``, two signed 4-bit codes in [-7, 7] per byte, the even column in
  the low nibble (two's complement nibbles);
- ``weight_scale``: fp32 ``[N]``, one scale per row.

Encoding, in the weight's own dtype as comfy-kitchen 0.2.40's eager quantizer does it: each
block of ``g`` input columns is multiplied by ``H_g^T`` (the regular Hadamard, ``H_4``'s
Kronecker powers over ``sqrt(g)``; a bf16 weight is rotated by a bf16 matmul, which the tests
show is independent of how many rows one call holds), ``s = max(amax|row|, 1e-10) / 7``,
``q = clamp(round_half_even(W_rot / s), -7, 7)``. Decoding: ``W = (q * s) H_g^T`` in fp32 (``H_g``
is symmetric and orthogonal, so this undoes the rotation).
"""

from __future__ import annotations

import torch

from h3quant.convrot import check_group_size, hadamard
from h3quant.errors import FormatError

INT4_MAX = 7
INT8_MAX = 127
QUANT_GROUP = 64  # the int4 kernel's group size: K must be a multiple of it
AMAX_MIN = 1e-10
CHUNK_ELEMS = 1 << 21
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_H: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


def _h_t(g: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """``H_g^T`` as a transposed view (the BLAS call, hence the rounding, follows the layout),
    on ``device`` (the CPU by default)."""
    dev = torch.device(device or "cpu")
    key = (g, dtype, str(dev))
    if key not in _H:
        _H[key] = hadamard(g, dev).to(dtype).contiguous()
    return _H[key].t()


def check_k(k: int, g: int) -> str | None:
    """Why a layer of input width ``k`` cannot be stored with group size ``g`` (None: it can)."""
    if k % g:
        return f"K={k} is not divisible by the ConvRot group size {g}"
    if k % QUANT_GROUP:
        return f"K={k} is not divisible by the int4 kernel's group size {QUANT_GROUP}"
    return None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[R, 2C]`` int8 codes -> ``[R, C]`` int8 bytes, the even column in the low nibble."""
    return (q[:, 0::2] & 0x0F) | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int8 bytes -> ``[R, 2C]`` signed codes in [-8, 7]."""
    out = torch.empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.int8,
                      device=packed.device)
    b = packed.view(torch.int8) if packed.dtype == torch.uint8 else packed
    out[:, 0::2] = (b << 4) >> 4  # arithmetic shifts sign-extend the nibble
    out[:, 1::2] = b >> 4
    return out


def rotate(w: torch.Tensor, g: int) -> torch.Tensor:
    """Rows ``w`` [n, K] in the ConvRot basis, in ``w``'s dtype: each block of ``g`` columns
    times ``H_g`` (a matmul with the transposed view, the encoder's rounding)."""
    n, k = w.shape
    return torch.matmul(w.reshape(n, k // g, g), _h_t(g, w.dtype, w.device)).reshape(n, k)


def _rows(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = w.shape[0]
    rot = rotate(w, g)
    amax = torch.maximum(rot.amax(1, keepdim=True), rot.amin(1, keepdim=True).neg())
    s = amax.clamp_(min=AMAX_MIN) / INT4_MAX
    q = torch.div(rot, s, out=rot).round_().clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return pack_int4(q), s.reshape(n).to(torch.float32)


def encode_int4_convrot(w: torch.Tensor, group_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 ``[N, K/2]``, fp32 scales ``[N]``) of float ``w`` ``[N, K]``. Rows are
    independent: a call on a row chunk equals the same rows of a call on the whole weight."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise FormatError(f"INT4 ConvRot weight must be 2-D [N, K], got {shape}")
    if w.dtype not in _FLOATS:
        raise FormatError(f"INT4 ConvRot weight must be a float tensor, got {w.dtype}")
    check_group_size(group_size)
    n, k = w.shape
    why = check_k(k, group_size)
    if why:
        raise FormatError(why)
    q = torch.empty((n, k // 2), dtype=torch.int8)
    s = torch.empty((n,), dtype=torch.float32)
    step = max(1, CHUNK_ELEMS // max(k, 1))
    for r0 in range(0, n, step):
        q[r0:r0 + step], s[r0:r0 + step] = _rows(w[r0:r0 + step], group_size)
    return q, s


def decode_int4_convrot(q: torch.Tensor, s: torch.Tensor, group_size: int = 256,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[R, K]`` in the original basis from packed ``q`` and row scales ``s``."""
    codes = unpack_int4(q).to(torch.float32)
    w_rot = codes * s.to(torch.float32).reshape(-1, 1)
    r, k = w_rot.shape
    g = group_size
    out = torch.matmul(w_rot.reshape(r, k // g, g), _h_t(g, torch.float32, w_rot.device)).reshape(r, k)
    return out.to(dtype)


def count_minus8(q: torch.Tensor) -> int:
    """Nibbles holding -8 (legal in storage, never written by the [-7, 7] quantizer)."""
    b = q.view(torch.int8) if q.dtype == torch.uint8 else q
    return int(((b & 0x0F) == 0x08).sum()) + int((((b >> 4) & 0x0F) == 0x08).sum())


def _quantize_rows_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int4 of ``x`` in its own dtype: (codes int8 in [-7, 7], scales [R])."""
    amax = torch.maximum(x.amax(1, keepdim=True), x.amin(1, keepdim=True).neg())
    s = amax.clamp_(min=AMAX_MIN) / INT4_MAX
    q = (x / s).round_().clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return q, s.reshape(-1).to(torch.float32)


def _quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 in fp32 (comfy-kitchen's activation quantizer):
    ``s = max(amax|row| / 127, 1e-30)``, codes ``clamp(round(x / s), -128, 127)``."""
    xf = x.to(torch.float32)
    s = (xf.abs().amax(1, keepdim=True) / INT8_MAX).clamp_(min=1e-30)
    q = (xf / s).round_().clamp_(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    return q, s.reshape(-1)


def _rotate_tokens(x: torch.Tensor, g: int) -> torch.Tensor:
    """``x`` flattened to ``[M, K]`` and rotated by ``H_g`` in its own dtype."""
    k = x.shape[-1]
    return torch.matmul(x.reshape(-1, k // g, g), _h_t(g, x.dtype, x.device).t()).reshape(-1, k)


def rounded_activations(x: torch.Tensor, group_size: int = 256,
                        bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` rotated, the same rounded to per-token int4 or int8 codes), both fp32 ``[M, K]``:
    the inputs ``w4a4_linear`` (``bits=4``) or ``w4a8_linear`` (``bits=8``) multiplies, as
    values (codes times their token's scale), rotated in ``x``'s dtype as they do."""
    x_rot = _rotate_tokens(x, group_size)
    qa, sa = (_quantize_rows_int4 if bits == 4 else _quantize_rows_int8)(x_rot)
    return x_rot.to(torch.float32), qa.to(torch.float32) * sa.reshape(-1, 1).to(torch.float32)


def w4a8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group_size: int = 256,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` the way comfy-kitchen's GPU kernels compute a convrot_w4a4 layer with int8
    activations (``linear_dtype: int8``, or any layer on a GPU without the int4 MMA route):
    ``x`` rotated by ``H_g``, per-token int8 codes and fp32 scales, the exact integer product of
    those codes with the int4 weight codes, then both scales in fp32, the bias, ``x.dtype``."""
    x_rot = _rotate_tokens(x, group_size)
    qa, sa = _quantize_rows_int8(x_rot)
    acc = qa.to(torch.float64) @ unpack_int4(q).to(torch.float64).t()  # exact: |acc| < 2^53
    out = acc.to(torch.float32) * sa.reshape(-1, 1) * s.reshape(1, -1).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32).reshape(1, -1)
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def w4a4_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group_size: int = 256,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` the way comfy-kitchen's eager W4A4 path computes it (ComfyUI without the
    int4 kernel): ``x`` rotated by ``H_g`` in its dtype, per-token int4 codes and scales, the
    code matmul in ``x.dtype``, then both scales and the bias, in ``x.dtype``."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    g = group_size
    x_rot = torch.matmul(x2.reshape(-1, k // g, g), _h_t(g, x.dtype, x.device).t()).reshape(-1, k)  # H itself
    qa, sa = _quantize_rows_int4(x_rot)
    out = qa.to(x.dtype) @ unpack_int4(q).to(x.dtype).t()
    out = out * sa.reshape(-1, 1).to(x.dtype)
    out = out * s.reshape(1, -1).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype).reshape(1, -1)
    return out.reshape(*x.shape[:-1], q.shape[0])
