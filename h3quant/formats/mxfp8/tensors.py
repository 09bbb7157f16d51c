"""The tensor work of ``mxfp8``: e4m3 codes with one e8m0 (power-of-two) scale per 32 values.

Encoding follows comfy-kitchen 0.2.40's eager ``quantize_mxfp8`` (what
``TensorCoreMXFP8Layout.quantize`` runs on the CPU) step for step, so the bytes are identical:

- per block of 32 along K: ``amax`` in the input dtype; ``scale = amax.float() / 448`` clamped
  to at least 2**-127; the e8m0 code is ``clamp(ceil(log2(scale)) + 127, 0, 254)``;
- codes: ``clamp(w.float() / 2**(code - 127), -448, 448).to(e4m3)`` (a code of 0 reads as a
  scale of 0 in kitchen; an all-zero block gets code 0 and zero codes);
- the scales ``[N, K/32]`` are stored in cuBLAS's blocked layout (128 x 4 tiles, each stored as
  32 x 16), padded to ``[roundup(N, 128), roundup(K/32, 4)]`` with zeros.

Rows are independent, and each 128-row tile of the stored scales depends only on its 128 rows,
so the work runs in 128-row chunks into preallocated outputs. Decoding follows kitchen's
``dequantize_mxfp8``: unswizzle, ``codes.float() * 2**(code - 127)`` (code 0 reads as 0).
"""

from __future__ import annotations

import torch

from h3quant.formats.blocked import TILE_COLS, TILE_ROWS, roundup, swizzle, unswizzle  # noqa: F401

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """Stored (swizzled, padded) shape of the block scales of an [n, k] weight."""
    return roundup(n, TILE_ROWS), roundup(k // BLOCK, TILE_COLS)


def e8m0_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """kitchen's reading of e8m0 bytes: ``2**(code - 127)``, with code 0 read as 0.0."""
    bits = codes.to(torch.int32) << 23
    return torch.where(codes == 0, torch.zeros_like(bits), bits).view(torch.float32)


def _encode_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows [r, K] (K % 32 == 0) -> e4m3 codes written into ``out`` [r, K]; returns the e8m0
    codes uint8 [r, K/32].

    kitchen divides by the power-of-two scale; multiplying by its reciprocal (also a power of
    two, or inf for a scale read as 0) gives the same correctly rounded fp32 values, NaN and
    infinities included."""
    r, k = x.shape
    # one fp32 copy of the rows (exact), reused in place; never the caller's own tensor
    f = x.to(torch.float32, copy=True).reshape(r, k // BLOCK, BLOCK)
    amax = torch.maximum(f.amax(dim=-1), f.amin(dim=-1).neg_())  # = amax(|x|), exact
    need = (amax / E4M3_MAX).clamp_(min=2.0 ** -127)
    code = torch.log2(need).ceil_().to(torch.int32).add_(E8M0_BIAS).clamp_(0, 254)
    zero = amax == 0
    code = code.masked_fill_(zero, 0).to(torch.uint8)
    scale = e8m0_to_f32(code)
    inv = torch.where(zero, torch.ones_like(scale), scale).reciprocal_()
    data = f.mul_(inv.unsqueeze(-1))  # zero blocks: 0 x 1
    data.clamp_(-E4M3_MAX, E4M3_MAX)
    out.copy_(data.reshape(r, k))
    return code


def encode_mxfp8(w: torch.Tensor, pool=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] with N and K multiples of 32 -> (e4m3 [N, K], e8m0 swizzled scales)."""
    if w.dim() != 2:
        raise ValueError(f"mxfp8 encode needs a 2-D weight, got {list(w.shape)}")
    n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"mxfp8 needs N and K divisible by {BLOCK}, got [{n}, {k}]")
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    pr, pc = scale_shape(n, k)
    scales = torch.zeros((pr, pc), dtype=torch.uint8)

    def work(r0: int) -> None:
        r1 = min(n, r0 + TILE_ROWS)
        s = _encode_rows(w[r0:r1], codes[r0:r1])
        scales[r0:r0 + TILE_ROWS] = swizzle(s)

    starts = range(0, n, TILE_ROWS)
    if pool is None:
        for r0 in starts:
            work(r0)
    else:
        for f in [pool.submit(work, r0) for r0 in starts]:
            f.result()
    return codes, scales.view(torch.float8_e8m0fnu)


def block_scales(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Stored scales (e8m0 or uint8 bytes) -> unswizzled uint8 codes [n, k/32]."""
    raw = scales.contiguous().view(torch.uint8) if scales.dtype != torch.uint8 else scales
    return unswizzle(raw, n, k // BLOCK)


def decode_mxfp8(codes: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.float32, row0: int = 0) -> torch.Tensor:
    """kitchen's ``dequantize_mxfp8`` of e4m3 ``codes`` and the layer's stored ``scales``.

    ``codes`` may be rows ``[row0, row0 + n)`` of the layer: only their scale tiles are read."""
    n, k = codes.shape
    t0 = row0 - row0 % TILE_ROWS
    t1 = roundup(row0 + n, TILE_ROWS)
    raw = scales.contiguous().view(torch.uint8) if scales.dtype != torch.uint8 else scales
    tiles = unswizzle(raw[t0:t1], t1 - t0, k // BLOCK)
    s = e8m0_to_f32(tiles[row0 - t0:row0 - t0 + n])
    data = codes.to(torch.float32).reshape(n, k // BLOCK, BLOCK) * s.unsqueeze(-1)
    return data.reshape(n, k).to(dtype)
