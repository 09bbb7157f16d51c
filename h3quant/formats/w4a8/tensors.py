"""asym_w4a8_int8 (W4A8) codec: pure tensor functions (FORMATS.md sections 2 and 4).

Stored per layer: ``weight`` int8 [N, K/2] (4-bit codes, even column in the low nibble),
``weight_s_rel`` e4m3 [N, K/G], ``weight_s_channel`` f32 [N] and, optional in the format but
always written by ``encode_w4a8``, ``weight_codebook`` f32 [16] (absent: ``level = code - 8``).
Runtime decode: ``w8 = clamp(round(level[code] * s_rel), -127, 127)`` then the int8 ConvRot linear
with ``s = s_channel``.
"""

from __future__ import annotations

from collections import deque

from concurrent.futures import Executor

import torch

from h3quant.convrot import is_valid_group_size, rotate, rotate_group_major
from h3quant.errors import FormatError, UnsupportedError
from h3quant.formats.w4a8.codebook import (
    FROZEN_CODEBOOK,
    LevelIndex,
    choose_codebook,
    sample_rows,
    take,
)
from h3quant.formats.w4a8.encoder import (
    DecodedLevels,
    encode_groups,
    encode_rows,
)

__all__ = [
    "FORMAT_NAME",
    "FROZEN_CODEBOOK",
    "decode_w4a8",
    "decode_w4a8_int8",
    "encode_w4a8",
    "pack_nibbles",
    "relative_l2",
    "unpack_nibbles",
]

FORMAT_NAME = "asym_w4a8_int8"
# e4m3 neighbours of each group scale tried by the final assignment (one ulp is 6-12.5%).
# Measured on [512, 5376] Gaussian: 0 -> 0.0730, 1 -> 0.0719, 2 -> 0.0714, 3 -> 0.0711.
SCALE_SEARCH_ULPS = 2
MAX_INFLIGHT_CHUNKS = 16  # W4A8 row chunks encoding at once, whatever --workers says
_ROW_ELEM_BUDGET = 1 << 19  # fp32 values per encode/decode chunk (2 MB per working tensor; measured
# 6 % faster encoding than 1 << 18, fewer per-chunk small ops; 1 << 20 was slower)


def relative_l2(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||w - w_hat|| / ||w|| accumulated in float64 over chunks (0.0 when both are zero)."""
    if w.shape != w_hat.shape:
        raise FormatError(f"relative_l2: shapes differ, {tuple(w.shape)} vs {tuple(w_hat.shape)}")
    a, b = w.reshape(-1), w_hat.reshape(-1)
    num = den = 0.0
    for i in range(0, a.numel(), _ROW_ELEM_BUDGET):
        x = a[i:i + _ROW_ELEM_BUDGET].double()
        num += (x - b[i:i + _ROW_ELEM_BUDGET].double()).square().sum().item()
        den += x.square().sum().item()
    return (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))


# ----------------------------------------------------------------------------- packing


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K] -> int8 [N, K/2]; byte = code[2j] | code[2j+1] << 4 (two's complement)."""
    if codes.dim() != 2:
        raise FormatError(f"codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    if codes.shape[1] % 2:
        raise FormatError(f"codes need an even number of columns, got K={codes.shape[1]}")
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise FormatError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise FormatError("codes must lie in 0..15")
    return _pack(codes)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).view(torch.int8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [N, K/2] -> uint8 codes [N, K] (inverse of ``pack_nibbles``)."""
    if packed.dim() != 2:
        raise FormatError(f"packed weight must be 2-D [N, K/2], got shape {tuple(packed.shape)}")
    if packed.dtype not in (torch.int8, torch.uint8):
        raise FormatError(f"packed weight must be int8 or uint8, got {packed.dtype}")
    p = packed.contiguous().view(torch.uint8)
    out = torch.empty(p.shape[0], p.shape[1] * 2, dtype=torch.uint8, device=p.device)
    out[:, 0::2] = p & 0x0F
    out[:, 1::2] = p >> 4
    return out


# ----------------------------------------------------------------------------- validation


def _check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 4 \
            or (16 % group_size and group_size % 16):
        raise FormatError(f"group_size must be >= 4 and divide 16 or be a multiple of 16, got {group_size!r}")


def _check_layout(k: int, group_size: int, convrot_groupsize: int) -> None:
    """K % 16, K % group_size and K % convrot_groupsize must all be 0 (FORMATS.md section 4)."""
    _check_group_size(group_size)
    if not is_valid_group_size(convrot_groupsize):
        raise FormatError(f"convrot_groupsize must be a power of 4 (4, 16, 64, 256, 1024), got {convrot_groupsize!r}")
    for div, name in ((16, "16"), (group_size, f"group_size {group_size}"),
                      (convrot_groupsize, f"convrot_groupsize {convrot_groupsize}")):
        if k % div:
            raise FormatError(f"W4A8 needs K % {div} == 0: K={k} is not a multiple of {name}")


def _s_rel_float(s_rel: torch.Tensor) -> torch.Tensor:
    """s_rel as float32; uint8 is read as e4m3 bits. Rejects NaN/inf (e4m3 0x7F/0xFF is NaN)."""
    if s_rel.dtype == torch.uint8:
        s_rel = s_rel.contiguous().view(torch.float8_e4m3fn)
    if not s_rel.dtype.is_floating_point:
        raise FormatError(f"weight_s_rel must be float8_e4m3fn (or uint8 e4m3 bits), got {s_rel.dtype}")
    s = s_rel.float()
    if not torch.isfinite(s).all():
        raise FormatError("weight_s_rel holds NaN or inf")
    return s


def _level_table(codebook: torch.Tensor | None, device) -> torch.Tensor:
    """The 16 decode levels: the stored codebook, else ``code - 8``."""
    if codebook is None:
        return torch.arange(-8, 8, dtype=torch.float32, device=device)
    if tuple(codebook.shape) != (16,) or not codebook.dtype.is_floating_point:
        raise FormatError(f"weight_codebook must be float [16], got {codebook.dtype} {tuple(codebook.shape)}")
    cb = codebook.to(device=device, dtype=torch.float32)
    if not torch.isfinite(cb).all():
        raise FormatError("weight_codebook holds NaN or inf")
    return cb


# ----------------------------------------------------------------------------- decode


def _check_packed(weight: torch.Tensor, weight_s_rel: torch.Tensor, group_size: int) -> tuple[int, int]:
    """(N, K) of a packed weight and its group scales, or FormatError."""
    _check_group_size(group_size)
    if weight.dim() != 2 or weight.dtype not in (torch.int8, torch.uint8):
        raise FormatError(f"W4A8 weight must be int8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % group_size:
        raise FormatError(f"K={k} (from weight [N, K/2]) is not a multiple of group_size {group_size}")
    if tuple(weight_s_rel.shape) != (n, k // group_size):
        raise FormatError(f"weight_s_rel must have shape {(n, k // group_size)}, got {tuple(weight_s_rel.shape)}")
    return n, k


def _decode_int8_rows(weight: torch.Tensor, s: torch.Tensor, table: torch.Tensor, group_size: int) -> torch.Tensor:
    codes = unpack_nibbles(weight).to(torch.int32)
    v = take(table, codes).view(codes.shape[0], -1, group_size).mul_(s.unsqueeze(-1))
    return v.round_().clamp_(-127, 127).view(codes.shape).to(torch.int8)


def decode_w4a8_int8(
    weight: torch.Tensor,
    weight_s_rel: torch.Tensor,
    *,
    group_size: int = 16,
    codebook: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed codes + group scales -> int8 [N, K] on the int8 grid the runtime multiplies.

    ``w8[n, k] = clamp(round(level[code] * s_rel[n, k // G]), -127, 127)``; without a codebook
    ``level = code - 8``. ``weight_s_rel`` may be e4m3, uint8 holding e4m3 bits, or float.
    """
    n, k = _check_packed(weight, weight_s_rel, group_size)
    s = _s_rel_float(weight_s_rel)
    table = _level_table(codebook, weight.device)
    out = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    step = max(1, _ROW_ELEM_BUDGET // max(k, 1))
    for r0 in range(0, n, step):
        out[r0:r0 + step] = _decode_int8_rows(weight[r0:r0 + step], s[r0:r0 + step], table, group_size)
    return out


def decode_w4a8(
    tensors: dict,
    *,
    group_size: int = 16,
    convrot_groupsize: int = 256,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Local tensors {"weight", "weight_s_rel", "weight_s_channel", ["weight_codebook"]} ->
    the dequantized weight in the original (un-rotated) basis: ``(w8 * s_channel) @ H_g`` per block."""
    for key in ("weight", "weight_s_rel", "weight_s_channel"):
        if key not in tensors:
            raise FormatError(f"W4A8 layer is missing '{key}'")
    if "weight_correction" in tensors:
        raise UnsupportedError("weight_correction (asymmetric W4A8) is not loaded by ComfyUI; refusing to decode it")
    weight, s_rel, s_ch = tensors["weight"], tensors["weight_s_rel"], tensors["weight_s_channel"]
    n, k = _check_packed(weight, s_rel, group_size)
    _check_layout(k, group_size, convrot_groupsize)
    if tuple(s_ch.shape) != (n,) or not s_ch.dtype.is_floating_point:
        raise FormatError(f"weight_s_channel must be float [{n}], got {s_ch.dtype} {tuple(s_ch.shape)}")
    s_ch = s_ch.to(device=weight.device, dtype=torch.float32)
    if not torch.isfinite(s_ch).all():
        raise FormatError("weight_s_channel holds NaN or inf")
    s = _s_rel_float(s_rel).to(weight.device)
    table = _level_table(tensors.get("weight_codebook"), weight.device)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    step = max(1, _ROW_ELEM_BUDGET // max(k, 1))
    for r0 in range(0, n, step):
        w8 = _decode_int8_rows(weight[r0:r0 + step], s[r0:r0 + step], table, group_size)
        out[r0:r0 + step] = rotate(w8.float() * s_ch[r0:r0 + step, None], convrot_groupsize).to(dtype)
    return out


# ----------------------------------------------------------------------------- encode


def _encode_rows(x: torch.Tensor, index: LevelIndex, group_size: int, search: int = SCALE_SEARCH_ULPS,
                 levels: DecodedLevels | None = None):
    """Rotated fp32 rows [n, K] -> (codes uint8 [n, K], s_rel e4m3 [n, K/G], s_channel f32 [n])."""
    return encode_rows(x, index, group_size, search, levels)


def encode_w4a8(
    weight: torch.Tensor,
    *,
    group_size: int = 16,
    convrot_groupsize: int = 256,
    codebook: str = "auto",
    scale_search: int = SCALE_SEARCH_ULPS,
    pool: Executor | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize a float weight [N, K] to W4A8 local tensors (no ``weight_correction``, ever).

    ``codebook``: "frozen" (the Lloyd-Max table), "fit" (k-means on the layer), or "auto" (fit
    only when it clearly pays, see ``w4a8_codebook.FIT_MIN_GAIN``). The table actually used is
    always stored as ``weight_codebook``: a file without it decodes ``level = code - 8``.
    ``scale_search``: e4m3 neighbours (+-ulps) of each group scale tried at the final
    assignment; 0 is kitchen's plain rounding, each step costs about one more assignment pass.
    ``pool``: an executor (e.g. a thread pool) that encodes the row chunks in parallel once the
    table is chosen; the output is the same, byte for byte.
    """
    if codebook not in ("auto", "frozen", "fit"):
        raise FormatError(f"codebook must be 'auto', 'frozen' or 'fit', got {codebook!r}")
    if not isinstance(scale_search, int) or isinstance(scale_search, bool) or not 0 <= scale_search <= 8:
        raise FormatError(f"scale_search must be an int in 0..8, got {scale_search!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise FormatError(f"W4A8 weight must be a 2-D tensor [N, K], got {shape}")
    if not weight.dtype.is_floating_point:
        raise FormatError(f"W4A8 weight must be floating point, got {weight.dtype}")
    n, k = weight.shape
    _check_layout(k, group_size, convrot_groupsize)
    if n == 0:
        raise FormatError("W4A8 weight has no rows")

    sample = rotate(sample_rows(weight).float(), convrot_groupsize)
    if not torch.isfinite(sample).all():
        raise FormatError("W4A8 weight holds NaN or inf")
    table, _fitted = choose_codebook(sample, group_size, codebook)
    del sample
    table = table.to(weight.device)
    index = LevelIndex(table)
    levels = DecodedLevels(table)

    packed = torch.empty(n, k // 2, dtype=torch.int8, device=weight.device)
    s_rel = torch.empty(n, k // group_size, dtype=torch.float8_e4m3fn, device=weight.device)
    s_channel = torch.empty(n, dtype=torch.float32, device=weight.device)
    levels.fine(index), levels.window(scale_search)  # built once, before any worker reads them

    def chunk(r0: int, r1: int) -> None:
        xt = rotate_group_major(weight[r0:r1], convrot_groupsize, group_size)
        codes, sr, sc = encode_groups(xt, r1 - r0, index, scale_search, levels, pack=True,
                                      rows=(r0, r1 - 1))
        packed[r0:r1], s_rel[r0:r1], s_channel[r0:r1] = codes, sr, sc  # disjoint rows

    step = max(1, _ROW_ELEM_BUDGET // k)
    spans = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]
    if pool is None:
        for span in spans:
            chunk(*span)
    else:  # row chunks are independent once the table is chosen: same bytes in any order
        # At most MAX_INFLIGHT_CHUNKS chunks are queued or running at once, so the working
        # memory (a few chunk-sized tensors each) is bounded whatever the worker count.
        futures: deque = deque()
        try:
            for span in spans:
                futures.append(pool.submit(chunk, *span))
                if len(futures) >= MAX_INFLIGHT_CHUNKS:
                    futures.popleft().result()  # the first failure in row order is reported
            while futures:
                futures.popleft().result()
        finally:
            for fut in futures:
                fut.cancel()
    return {"weight": packed, "weight_s_rel": s_rel, "weight_s_channel": s_channel,
            "weight_codebook": table.to(torch.float32, copy=True)}
