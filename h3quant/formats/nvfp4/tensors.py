"""nvfp4 tensor work: encode float rows into e2m1 codes with two-level scales, and decode them.

The layout (docs/FORMATS.md, nvfp4):

- ``weight``: uint8 ``[Np, Kp/2]``, ``Np = roundup(N, 16)``, ``Kp = roundup(K, 16)`` (zero padded);
  two e2m1 codes per byte, the even column in the high nibble.
- ``weight_scale``: float8_e4m3fn block scales, one per 16 values of a row, stored in cuBLAS's
  blocked layout for 1-D block scaling: the ``[Np, Kp/16]`` grid padded with zeros to
  ``[roundup(Np, 128), roundup(Kp/16, 4)]`` and cut into 128 x 4 tiles, tile-major; inside a
  tile, row ``32 i + j`` column ``c`` is stored at tile row ``j``, tile column ``4 i + c``.
- ``weight_scale_2``: fp32 scalar tensor scale ``t = amax|W| / (448 * 6)``, computed in the
  weight's dtype (a bf16 weight gives a bf16-rounded ``t``).

A value decodes as ``code * t * block_scale``. Encoding: per block ``b = amax|block| / 6`` (fp32),
``s = fp8(min(b / t, 448))``, ``v = x / (t * s)`` clamped to +-6, rounded to the nearest e2m1 value
(ties to even), signed zero kept. This is comfy-kitchen 0.2.40's eager quantizer; tests compare
the bytes with it.
"""

from __future__ import annotations

import torch

from h3quant.formats.blocked import TILE_COLS, TILE_ROWS, roundup, swizzle, unswizzle  # noqa: F401

from h3quant.errors import FormatError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ROW_STEP = 256  # rows per internal chunk (temporaries stay small; faster than 1024 here)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# e2m1 magnitudes by code; round-to-nearest-even thresholds between neighbours:
# (a > t) for odd-to-even steps that round down on a tie, (a >= t) where the tie goes up
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_UP_STRICT = (0.25, 1.25, 2.5, 5.0)  # a tie stays on the lower (even) code
_UP_TIE = (0.75, 1.75, 3.5)  # a tie moves to the upper (even) code


def storage_shapes(n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Stored shapes of a logical ``[n, k]`` weight."""
    np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
    return {"weight": (np_, kp // 2),
            "weight_scale": (roundup(np_, TILE_ROWS), roundup(kp // BLOCK, TILE_COLS)),
            "weight_scale_2": ()}


# --------------------------------------------------------------------------- block-scale layout


# --------------------------------------------------------------------------- e2m1 codes


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to even, sign bit 8 from the float's sign) of fp32 ``v``."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _UP_STRICT:
        code += a > t
    for t in _UP_TIE:
        code += a >= t
    code |= torch.signbit(v).to(torch.uint8) << 3
    return code


def scaled_codes(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of ``x / total`` (``total = t * s``, broadcast to ``x``): the encoder's fp32
    arithmetic, the quotient clamped to +-6 and rounded to the nearest e2m1 value (ties to
    even); a zero scale gives code 0."""
    zero = total == 0
    v = x.to(torch.float32) / torch.where(zero, torch.ones_like(total), total)
    v = torch.where(zero, torch.zeros_like(v), v).clamp_(-E2M1_MAX, E2M1_MAX)
    return e2m1_codes(v)


def pack_hi_first(codes: torch.Tensor) -> torch.Tensor:
    """``[R, 2C]`` nibbles -> ``[R, C]`` bytes, the even column in the high nibble."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_hi_first(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.uint8,
                      device=packed.device)
    out[:, 0::2] = packed >> 4
    out[:, 1::2] = packed & 0x0F
    return out


# --------------------------------------------------------------------------- encode / decode


def tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """``amax|W| / 2688`` in ``w``'s dtype, as an fp32 scalar (``weight_scale_2``)."""
    return scale_from_amax(amax_of(w))


def amax_of(w: torch.Tensor) -> torch.Tensor:
    """``amax|W|`` in ``w``'s dtype, ``ROW_STEP`` rows at a time (0 for no rows)."""
    amax = torch.zeros((), dtype=w.dtype)
    for r0 in range(0, w.shape[0], ROW_STEP):
        part = w[r0:r0 + ROW_STEP]
        amax = torch.maximum(amax, torch.maximum(part.amax(), part.amin().neg()))
    return amax


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``tensor_scale`` from the weight's ``amax|W|`` (in the weight's dtype)."""
    return (amax.abs() / (E4M3_MAX * E2M1_MAX)).to(torch.float32)


def _check(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise FormatError(f"nvfp4 weight must be 2-D [N, K], got {shape}")
    if w.dtype not in _FLOATS:
        raise FormatError(f"nvfp4 weight must be a float tensor, got {w.dtype}")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise FormatError(f"nvfp4 weight is empty: {tuple(w.shape)}")


def _encode_rows(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, fp8 block-scale bytes ``[rows, K/16]``) of zero-padded rows ``x``."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    peak = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg()).abs_().to(torch.float32)  # +0, never -0
    s8 = torch.clamp(peak / E2M1_MAX / t, max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = t * s8.to(torch.float32)
    codes = scaled_codes(blocks, total.unsqueeze(-1)).reshape(rows, k)
    return pack_hi_first(codes), s8.view(torch.uint8)


def encode_nvfp4(w: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``{"weight", "weight_scale", "weight_scale_2"}`` of float ``w`` ``[N, K]``.

    ``scale``: the fp32 tensor scale to use (default: ``amax|W| / 2688`` in ``w``'s dtype).
    Rows are encoded ``ROW_STEP`` at a time; the result equals one pass over the whole weight."""
    _check(w)
    n, k = w.shape
    shapes = storage_shapes(n, k)
    t = tensor_scale(w) if scale is None else scale.reshape(()).to(torch.float32)
    if not bool(torch.isfinite(t)):
        raise FormatError("weight holds NaN or inf; cannot quantize to nvfp4")
    np_, kp = roundup(n, BLOCK), roundup(k, BLOCK)
    q = torch.empty(shapes["weight"], dtype=torch.uint8)
    grid = torch.empty((np_, kp // BLOCK), dtype=torch.uint8)
    for r0 in range(0, np_, ROW_STEP):
        r1 = min(np_, r0 + ROW_STEP)
        x = w[r0:min(r1, n)]
        if x.shape != (r1 - r0, kp):
            x = torch.nn.functional.pad(x, (0, kp - k, 0, (r1 - r0) - x.shape[0]))
        q[r0:r1], grid[r0:r1] = _encode_rows(x, t)
    return {"weight": q, "weight_scale": swizzle(grid).view(torch.float8_e4m3fn),
            "weight_scale_2": t.clone()}


def block_scales(weight_scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 ``[rows, cols]`` block scales from the stored (blocked) fp8 tensor."""
    raw = weight_scale.view(torch.uint8) if weight_scale.dtype != torch.uint8 else weight_scale
    return unswizzle(raw, rows, cols).contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def decode_nvfp4(q: torch.Tensor, weight_scale: torch.Tensor, scale: torch.Tensor,
                 rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 grid: torch.Tensor | None = None) -> torch.Tensor:
    """Decoded ``[R, Kp]`` weight (padding included) of packed codes ``q`` ``[R, Kp/2]``.

    ``rows``: which stored rows ``q`` holds (default: the first ``R``); ``grid``: the block
    scales already unswizzled. ``dtype`` is also the dtype of the scale product, as in
    comfy-kitchen's dequantize (fp32: exact)."""
    r, kp = q.shape[0], q.shape[1] * 2
    if grid is None:
        np_ = weight_scale.shape[0] if rows is not None else r
        grid = block_scales(weight_scale, np_, kp // BLOCK)
    grid = grid[rows] if rows is not None else grid[:r]
    lut = torch.tensor(_E2M1 + tuple(-x for x in _E2M1), dtype=dtype, device=q.device)
    vals = lut[unpack_hi_first(q).long()]
    total = scale.reshape(()).to(dtype) * grid.to(dtype)
    return (vals.reshape(r, kp // BLOCK, BLOCK) * total.unsqueeze(-1)).reshape(r, kp)


# --------------------------------------------------------------------------- data checks


def _block_peaks(q: torch.Tensor) -> torch.Tensor:
    """Per 16-value block, the largest |code| index (0..7) of packed ``q`` ``[R, Kp/2]``."""
    mag = unpack_hi_first(q) & 0x07
    return mag.reshape(q.shape[0], -1, BLOCK).amax(-1)


def roughness(grid_bytes: torch.Tensor) -> float:
    """Mean |log2| step between horizontally adjacent non-zero block scales of a ``[R, C]``
    grid. A weight's block scales follow its rows (a row's blocks share its magnitude), so the
    right reading of the stored bytes is the smoother one."""
    v = grid_bytes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    if v.shape[1] < 2:
        return 0.0
    a, b = v[:, 1:], v[:, :-1]
    both = (a > 0) & (b > 0) & torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return 0.0
    return float((a[both].log2() - b[both].log2()).abs().mean())


def deep_violations(q: torch.Tensor, scale_bytes: torch.Tensor) -> list[tuple[str, str, str]]:
    """(code, message, suffix) data findings of an nvfp4 layer: block-scale values and layout.

    ``q``: the packed weight ``[Np, Kp/2]`` (uint8); ``scale_bytes``: the stored block scales
    as uint8 of their stored 2-D shape."""
    out = []
    raw = scale_bytes
    nan = (raw & 0x7F) == 0x7F
    neg = ((raw & 0x80) != 0) & ((raw & 0x7F) != 0) & ~nan
    if bool(nan.any()):
        out.append(("D120", f"{int(nan.sum())} of {raw.numel()} e4m3 block scales are NaN; "
                    "expected finite scales", "weight_scale"))
    if bool(neg.any()):
        out.append(("D120", f"{int(neg.sum())} of {raw.numel()} e4m3 block scales are negative; "
                    "the encoder writes scales >= 0", "weight_scale"))
    rows, cols = q.shape[0], q.shape[1] * 2 // BLOCK
    rp, cp = raw.shape
    if rp < rows or cp < cols or rp % TILE_ROWS or cp % TILE_COLS:
        return out  # the header rules report the shape
    blocked = unswizzle(raw, rp, cp)
    pad = blocked.clone()
    pad[:rows, :cols] = 0
    if bool(pad.any()):
        out.append(("D121", f"{int((pad != 0).sum())} block scales in the blocked layout's padding "
                    "are not zero (expected zeros outside the [N, K/16] grid)", "weight_scale"))
    grid = blocked[:rows, :cols]
    zero_bad = int((((grid & 0x7F) == 0) & (_block_peaks(q) != 0)).sum())
    if zero_bad:
        out.append(("D120", f"{zero_bad} blocks have a zero block scale over non-zero codes "
                    "(their values are lost)", "weight_scale"))
    if rp == rows and cp == cols and rows > 32:  # the same bytes also read as a plain grid
        as_blocked, as_plain = roughness(grid), roughness(raw)
        if as_plain < 0.7 * as_blocked:
            out.append(("D121", "the block scales follow the rows when read as a plain row-major "
                        f"[{rows}, {cols}] grid (mean log2 step {as_plain:.2f} vs {as_blocked:.2f} "
                        "in the blocked layout): they were not swizzled into cuBLAS's blocked "
                        "128 x 4 layout, so every block decodes with another block's scale",
                        "weight_scale"))
    return out
