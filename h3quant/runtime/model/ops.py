"""The tensor operations of the H3 forward (FORMATS.md 5.1), written for any device.

Everything here is plain torch (no device branches, no fused kernels), so the simulated NPU and
MPS devices run exactly the same code as the CPU:

- ``rms_norm``: RMSNorm over the last dim, eps 1e-5, computed in fp32, result in x's dtype;
- ``rope_angles`` / ``RopeTable`` / ``apply_rope``: the "split half" rotary embedding on the
  first 96 of the 128 head dims (pairs ``(i, i + 48)``), angles from 3-axis positions;
- ``attention``: ``softmax(q k^T / sqrt(d)) v`` over the whole packed sequence, fp32, no mask,
  computed a few heads at a time so the score matrix stays bounded;
- ``swiglu``: ``silu(gate) * up`` of ``[gate | up]``;
- ``modulate`` / ``gated_residual``: the adaLN affine (rounded per operation, as the
  reference's in-place ``mul_`` / ``add_``) and the gated residual (one rounding, as the
  reference's ``addcmul_``), each packed segment with its own modulation row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h3quant.errors import VerifyError

RMS_EPS = 1e-5
ROPE_DIMS = 96  # rotated prefix of each 128-wide head
SCORE_BUDGET_ELEMS = 1 << 25  # fp32 attention scores held at once (128 MB)

# (start, stop, modulation row): one contiguous run of packed rows and the adaLN row it uses
Segment = tuple[int, int, int]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = RMS_EPS) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32; result in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[S, 3] positions (t, h, w) and [F] inverse frequencies -> [S, 3F] fp32 angles, t|h|w."""
    pos = positions.to(torch.float32)
    inv = inv_freq.to(device=pos.device, dtype=torch.float32)
    return (pos[:, :, None] * inv[None, None, :]).reshape(pos.shape[0], -1)


@dataclass(frozen=True)
class RopeTable:
    """cos and sin of the pair angles, [S, 1, P] in the compute dtype (P = rotated dims / 2)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def from_angles(cls, angles: torch.Tensor, dtype: torch.dtype) -> "RopeTable":
        a = angles[:, None, :]
        return cls(torch.cos(a).to(dtype), torch.sin(a).to(dtype))

    @property
    def rotated_dims(self) -> int:
        return 2 * self.cos.shape[-1]

    def to(self, device) -> "RopeTable":
        return RopeTable(self.cos.to(device), self.sin.to(device))


def apply_rope(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """Rotate pairs ``(i, i + P)`` of the first ``2P`` dims of x [S, H, D]; the rest pass through."""
    p = rope.cos.shape[-1]
    if x.shape[-1] < 2 * p:
        raise VerifyError(f"head dim {x.shape[-1]} is smaller than the {2 * p} rotated dims")
    lo, hi, rest = x[..., :p], x[..., p:2 * p], x[..., 2 * p:]
    c, s = rope.cos.to(x.dtype), rope.sin.to(x.dtype)
    return torch.cat((lo * c - hi * s, hi * c + lo * s, rest), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, rope: RopeTable | None):
    """Per-head RMSNorm of q and k [S, H, D], then RoPE when ``rope`` is given."""
    q, k = rms_norm(q, q_weight), rms_norm(k, k_weight)
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    return q, k


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q, k, v [S, H, D] -> [S, H * D] in q's dtype (fp32 math, no mask,
    scale 1/sqrt(D)); heads are taken in groups so at most ``SCORE_BUDGET_ELEMS`` scores live."""
    s, h, d = q.shape
    sk = max(k.shape[0], 1)
    step = max(1, min(h, SCORE_BUDGET_ELEMS // max(s * sk, 1)))
    # one head's scores beyond the budget: query rows in blocks too (each row's softmax is its
    # own, so the result does not depend on the blocking)
    rows = s if step > 1 else max(1, min(s, SCORE_BUDGET_ELEMS // sk))
    out = torch.empty((s, h, d), dtype=q.dtype, device=q.device)
    scale = d ** -0.5
    for h0 in range(0, h, step):
        kf = k[:, h0:h0 + step].float().transpose(0, 1)
        vf = v[:, h0:h0 + step].float().transpose(0, 1)
        for r0 in range(0, s, rows):
            qf = q[r0:r0 + rows, h0:h0 + step].float().transpose(0, 1)
            w = torch.softmax((qf @ kf.transpose(-2, -1)) * scale, dim=-1)
            out[r0:r0 + rows, h0:h0 + step] = (w @ vf).transpose(0, 1).to(q.dtype)
    return out.reshape(s, h * d)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the two contiguous halves ``[gate | up]`` of the last dim."""
    if x.shape[-1] % 2:
        raise VerifyError(f"SwiGLU input width {x.shape[-1]} is odd")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
             segments: list[Segment]) -> torch.Tensor:
    """``h * (1 + scale[row]) + shift[row]`` per segment; shift/scale are [rows, hidden]."""
    out = torch.empty_like(h)
    for a, b, row in segments:
        out[a:b] = h[a:b] * (1 + scale[row].to(h.dtype)) + shift[row].to(h.dtype)
    return out


def gated_residual(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                   segments: list[Segment]) -> torch.Tensor:
    """``x + gate[row] * update`` per segment, rounded to x's dtype ONCE (a new tensor; x is
    not modified).

    The gate row is first cast to x's dtype (as the reference does), then the product and the
    sum are formed in fp32 and rounded once: the fused multiply-add of the reference
    (``addcmul``) on every device. The product of two bf16 / fp16 values is exact in fp32, so a
    reduced-precision stream sees exactly one rounding; an fp32 stream computes ``x + g * u``
    as before.
    """
    out = torch.empty_like(x)
    wide = torch.promote_types(x.dtype, torch.float32)
    for a, b, row in segments:
        g = gate[row].to(x.dtype).to(wide)
        u = update[a:b]
        if u.dtype != x.dtype and u.dtype != wide:
            u = u.to(x.dtype)
        out[a:b] = (x[a:b].to(wide) + g * u.to(wide)).to(x.dtype)
    return out


def check_segments(segments: list[Segment], rows: int) -> None:
    """Segments must tile ``0..rows`` contiguously."""
    pos = 0
    for a, b, _ in segments:
        if a != pos or b < a:
            raise VerifyError(f"packed segments do not tile the sequence at row {pos}: {segments}")
        pos = b
    if pos != rows:
        raise VerifyError(f"packed segments cover {pos} rows, the sequence has {rows}")
