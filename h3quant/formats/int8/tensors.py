"""int8_tensorwise codec, optionally ConvRot-rotated (FORMATS.md section 3). Pure tensor functions.

Weights: ``W = weight.float()``; if ConvRot, ``W_rot = W @ H_g`` per block of ``g`` columns;
``s = max(absmax_row / 127, 1e-30)``; ``q = round_half_even(W_rot / s)`` as int8.

ConvRot ``method`` of ``encode_int8``:
- ``"exact"`` (default): codes and scales bit-identical to comfy-kitchen's encoder on the same
  device and BLAS, via ``rotate_exact`` (kitchen's dense matmul at half the flops where the
  BLAS's summation order allows, verified at first use; else the dense matmul itself).
- ``"dense"``: kitchen's own operation (a ``g x g`` matmul per block), chunked by rows.
- ``"fast"``: the fast rotation; off by one ulp in some scales and by one in a few codes in a
  million (where ``W_rot / s`` sits on a .5 boundary). Not bit-exact.
Each row's result is independent of how many rows are passed, so row-chunked calls equal one
call on the whole weight.
"""

from __future__ import annotations

import torch

from h3quant.convrot import check_group_size
from h3quant.convrot.rotation import rotate_chunk_, rotate_dense, rotate_exact
from h3quant.errors import FormatError, UnsupportedError

FORMAT = "int8_tensorwise"
SCALE_MIN = 1e-30
CHUNK_ELEMS = 1 << 20  # elements per internal row chunk (4 MiB as fp32)
METHODS = ("exact", "dense", "fast")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _row_step(k: int) -> int:
    return max(1, CHUNK_ELEMS // max(k, 1))


def _check_weight(weight: torch.Tensor, convrot: bool, group_size: int, per_row: bool) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise FormatError(f"int8 weight must be 2-D [N, K], got {shape}")
    if weight.dtype not in _FLOATS:
        raise FormatError(f"int8 weight must be a float tensor, got {weight.dtype}")
    if weight.shape[1] == 0:
        raise FormatError("int8 weight has no input features (K = 0)")
    if convrot:
        check_group_size(group_size)
        if weight.shape[1] % group_size:
            raise FormatError(
                f"ConvRot group size {group_size} does not divide the input features K={weight.shape[1]}"
            )
        if not per_row:
            raise UnsupportedError("ConvRot int8 needs per-row scales (comfy-kitchen rejects a scalar scale)")


def _finite_or_raise(amax: torch.Tensor, r0: int) -> None:
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        row = int(bad.reshape(-1).nonzero()[0, 0]) + r0
        raise FormatError(f"weight holds NaN or inf (row {row}); cannot quantize")


def _absmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``max_k |x[:, k]|`` as ``[rows, 1]`` (two reductions, no ``|x|`` temporary)."""
    return torch.maximum(x.amax(1, keepdim=True), x.amin(1, keepdim=True).neg_())


def _codes_(v: torch.Tensor, out: torch.Tensor, clamp: bool = True) -> None:
    """``out = clamp(round_half_even(v), -128, 127)`` as int8; ``v`` is clobbered.

    ``clamp=False`` where ``v = x / s`` with ``s = max(absmax / 127, 1e-30)`` of finite ``x``:
    then ``|v| <= 127 * (1 + 2**-23)``, which rounds to at most 127, so the clamp is a no-op.
    """
    v.round_()
    out.copy_(v.clamp_(-128.0, 127.0) if clamp else v)


def _rotation(convrot: bool, g: int, method: str):
    """The per-chunk transform applied before scaling: a ConvRot rotation, or none (fp32 copy)."""
    if not convrot:
        return lambda x: x
    if method == "fast":
        return lambda x: rotate_chunk_(x.contiguous(), g, torch.empty_like(x))
    if method == "dense":
        return lambda x: rotate_dense(x, g)
    return lambda x: rotate_exact(x, g)


def _encode_per_row(weight: torch.Tensor, transform) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=weight.device)
    step = _row_step(k)
    for i in range(0, n, step):
        rot = transform(weight[i:i + step].to(torch.float32, copy=True))
        a = _absmax_rows(rot)
        _finite_or_raise(a, i)
        s = (a / 127.0).clamp_(min=SCALE_MIN)
        scale[i:i + step] = s
        _codes_(rot.div_(s), q[i:i + step], clamp=False)
    return q, scale


def _encode_tensorwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    step = _row_step(k)
    amax = torch.zeros((), dtype=torch.float32, device=weight.device)
    for i in range(0, n, step):
        a = _absmax_rows(weight[i:i + step]).to(torch.float32)
        _finite_or_raise(a, i)
        amax = torch.maximum(amax, a.max())
    scale = (amax / 127.0).clamp_(min=SCALE_MIN)
    for i in range(0, n, step):
        _codes_(weight[i:i + step].to(torch.float32, copy=True).div_(scale), q[i:i + step], clamp=False)
    return q, scale


def encode_int8(
    weight: torch.Tensor,
    *,
    convrot: bool = True,
    group_size: int = 256,
    per_row: bool = True,
    method: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``[N, K]`` weight: ``(q int8 [N, K], scale f32 [N, 1] or [])``.

    Raises ``FormatError`` for a non-2-D or non-float weight, ``K % group_size != 0``, an invalid
    group size or NaN/inf values; ``UnsupportedError`` for ConvRot with a scalar scale.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_weight(weight, convrot, group_size, per_row)
    if not per_row:
        return _encode_tensorwise(weight)
    return _encode_per_row(weight, _rotation(convrot, group_size, method))


def encode_int8_in_dtype(weight: torch.Tensor, *, convrot: bool = True,
                         group_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 as comfy-kitchen makes it from a weight in its own dtype (bf16 / f16):
    the rotation, the row peaks and the division in that dtype, the scale stored in float32
    from the rounded peak, the division by the scale rounded to that dtype. Rows then peak at
    126-128 (with -128 codes) where the float32 encode gives 127: a valid file with a larger
    error. ``(q int8 [N, K], scale f32 [N, 1])``; the whole layer at once (kitchen's shapes,
    so the same BLAS calls and bytes)."""
    _check_weight(weight, convrot, group_size, True)
    n, k = weight.shape
    x = weight
    if convrot:
        from h3quant.convrot.rotation import hadamard

        h = hadamard(group_size, weight.device).to(weight.dtype)  # +-2^-j: exact in bf16
        x = torch.matmul(weight.reshape(n, k // group_size, group_size), h.T).reshape(n, k)
    a = x.abs().amax(dim=-1, keepdim=True)
    _finite_or_raise(a.float(), 0)
    scale = (a.float() / 127.0).clamp(min=SCALE_MIN)
    s = scale.to(x.dtype)
    s = torch.where(s == 0, torch.full_like(s, torch.finfo(x.dtype).tiny), s)
    q = (x / s).round_().clamp_(-128.0, 127.0).to(torch.int8)
    return q, scale


def decode_int8(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    convrot: bool,
    group_size: int = 256,
    dtype: torch.dtype = torch.float32,
    exact: bool = True,
) -> torch.Tensor:
    """Dequantize to the un-rotated weight: ``(q.float() * s) @ H_g`` per block, cast to ``dtype``.

    ``scale``: ``[N, 1]``, ``[N]`` or ``[]``. ``exact`` (default): bit-identical to kitchen's
    dequantize on the same device and BLAS (``rotate_exact``); ``exact=False`` uses the fast
    rotation, about twice as fast and equal to fp32 rounding.
    """
    if q.dim() != 2 or q.dtype != torch.int8:
        raise FormatError(f"int8 weight must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if scale.numel() == 1 and scale.dim() <= 1:
        s = scale.reshape(())
    elif tuple(scale.shape) in ((n, 1), (n,)):
        s = scale.reshape(n, 1)
    else:
        raise FormatError(f"int8 weight_scale shape {tuple(scale.shape)} does not fit weight {(n, k)}")
    if convrot:
        check_group_size(group_size)
        if k % group_size:
            raise FormatError(f"ConvRot group size {group_size} does not divide K={k}")
    s = s.to(device=q.device, dtype=torch.float32)
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    step = _row_step(k)
    for i in range(0, n, step):
        # contiguous: a transposed view (the kn layout's rows) must round like stored rows
        w = q[i:i + step].to(torch.float32, memory_format=torch.contiguous_format)
        w = w * (s if s.dim() == 0 else s[i:i + step])
        if convrot:
            w = rotate_exact(w, group_size) if exact else rotate_chunk_(w, group_size, torch.empty_like(w))
        out[i:i + step] = w
    return out


def quantize_activation(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic int8 of ``[M, K]`` activations: ``(q_x int8 [M, K], s_x f32 [M])``.

    ``s_x = max(absmax_row / 127, 1e-30)``; ``q_x = clamp(round_half_even(x / s_x), -128, 127)``,
    computed in fp32 on ``x2d``'s device (kitchen's per-row activation quantizer).
    """
    if x2d.dim() != 2 or x2d.dtype not in _FLOATS:
        raise FormatError(f"activation must be a 2-D float tensor, got {x2d.dtype} {tuple(x2d.shape)}")
    m, k = x2d.shape
    if k == 0:
        raise FormatError("activation has no features (K = 0)")
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    sx = torch.empty(m, dtype=torch.float32, device=x2d.device)
    step = _row_step(k)
    for i in range(0, m, step):
        x = x2d[i:i + step].to(torch.float32, copy=True)
        s = (x.abs().amax(1, keepdim=True) / 127.0).clamp_(min=SCALE_MIN)
        sx[i:i + step] = s.reshape(-1)
        _codes_(x.div_(s), q[i:i + step])
    return q, sx


def encode_int8_calibrated(weight: torch.Tensor, calibration, *, convrot: bool = True,
                           group_size: int = 256, method: str = "exact"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode_int8``'s per-row scales, codes chosen by ``calibration``'s error feedback.

    ``calibration.feedback(x, quantize, convrot=, group_size=)`` (``h3quant.calibration``)
    walks the columns and asks ``quantize(v, j)`` for the nearest level of column ``j``: here
    ``clamp(round_half_even(v / s), -127, 127)``, the very arithmetic of ``encode_int8``, so
    statistics that give no feedback (an identity Hessian) reproduce its codes bit for bit.
    Codes never reach -128."""
    _check_weight(weight, convrot, group_size, True)
    rot = _rotation(convrot, group_size, method)(weight.to(torch.float32, copy=True))
    a = _absmax_rows(rot)
    _finite_or_raise(a, 0)
    s = (a / 127.0).clamp_(min=SCALE_MIN)
    s1 = s.reshape(-1)

    def quantize(v: torch.Tensor, j: int):
        c = (v / s1).round_().clamp_(-127.0, 127.0)
        return c, c * s1

    codes = calibration.feedback(rot, quantize, convrot=convrot, group_size=group_size)
    return codes.to(torch.int8), s


__all__ = ["FORMAT", "METHODS", "decode_int8", "encode_int8", "encode_int8_calibrated",
           "quantize_activation"]
