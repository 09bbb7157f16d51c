"""The tensor work of the per-tensor fp8 formats (``float8_e4m3fn``, ``float8_e5m2``).

Encoding follows comfy-kitchen 0.2.40's eager CPU quantizer (``TensorCoreFP8Layout.quantize``
with ``scale=None``) step for step, so the codes are byte-identical for the same input:

- the scale is ``amax(|w|) / finfo(fp8).max`` computed in the input's dtype, then kept as fp32;
- the codes are ``clamp(w * (1 / scale).to(w.dtype), -max, max).to(fp8)``: the reciprocal is
  rounded to the input dtype, the product is rounded to the input dtype, then to fp8.

The work runs in row chunks into one preallocated output (optionally on a thread pool), so the
rounding happens element by element exactly as in the one-shot expression. Decoding follows
kitchen's ``dequantize_per_tensor_fp8``: ``codes.to(dtype) * scale.to(dtype)``.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
CHUNK_ELEMS = 1 << 20  # elements per work chunk (a few MiB of temporaries)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def tensor_scale(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kitchen's per-tensor scale: ``amax(|w|) / max`` in ``w``'s dtype, returned as fp32 [].

    An all-zero weight would give scale 0 (and NaN codes in kitchen); it gets scale 1 instead
    (codes all zero), the only deviation from kitchen, which never produces a usable file there."""
    return scale_from_amax(amax_of(w), dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor_scale`` from the weight's ``amax(|w|)`` (in the weight's dtype)."""
    scale = (amax / fp8_max(dtype)).to(torch.float32)
    if float(scale) == 0.0:
        scale = torch.ones((), dtype=torch.float32)
    return scale.reshape(())


def amax_of(w: torch.Tensor) -> torch.Tensor:
    """``amax(|w|)`` over the tensor in its dtype, row chunk by row chunk (no full |w| copy)."""
    flat = w.reshape(-1)
    step = CHUNK_ELEMS
    best = None
    for i in range(0, flat.numel(), step):
        m = flat[i:i + step].abs().amax()
        best = m if best is None else torch.maximum(best, m)
    return best if best is not None else torch.zeros((), dtype=w.dtype)


def encode_fp8(w: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
               pool=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (bf16, f16 or f32) -> (fp8 codes [N, K], fp32 scale [])."""
    if w.dim() != 2:
        raise ValueError(f"fp8 encode needs a 2-D weight, got {list(w.shape)}")
    if scale is None:
        scale = tensor_scale(w, dtype)
    inv = (1.0 / scale.to(torch.float32)).to(w.dtype)
    lim = fp8_max(dtype)
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype)
    rows = max(1, CHUNK_ELEMS // max(k, 1))

    def work(r0: int) -> None:
        r1 = min(n, r0 + rows)
        t = torch.mul(w[r0:r1], inv)
        torch.clamp(t, -lim, lim, out=t)
        out[r0:r1].copy_(t)

    starts = range(0, n, rows)
    if pool is None:
        for r0 in starts:
            work(r0)
    else:
        for f in [pool.submit(work, r0) for r0 in starts]:
            f.result()
    return out, scale


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kitchen's ``dequantize_per_tensor_fp8``: ``codes.to(dtype) * scale.to(dtype)``."""
    return codes.to(dtype).mul_(scale.to(dtype))  # in place: one copy of the weight


def nonfinite_codes(codes: torch.Tensor) -> int:
    """How many fp8 codes decode to NaN or infinity."""
    return int((~torch.isfinite(codes.to(torch.float32))).sum())
