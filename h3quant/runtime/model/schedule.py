"""Sampler schedules and the output-head bank of few-step (distilled) checkpoints (FORMATS.md 15).

A checkpoint may store a *bank* of ``n`` output heads: ``final_layer.video_out`` holds
``n * 96`` rows and ``final_layer.audio_out`` ``n * 32`` (bias likewise). Row block 0 is a full
head; blocks ``1..n-1`` are offsets from it. A sampler step uses head 0 plus the offsets of the
heads its span covers, each weighted by its share of the span:

- the step ``i`` is the schedule entry nearest to the model's sigma, and ``next`` the entry after
  it (the last one for the last step);
- with ``base(s) = s / (12 + s * (1 - 12))`` (the sigma mapped back to the unshifted grid), the
  span is ``start = round((1 - base(sigma)) * n)``, ``stop = round((1 - base(next)) * n)``, then
  ``start = min(start, n - 1)`` and ``stop = max(stop, start + 1)``;
- on the grid ``g = linspace(1, 0, n + 1)`` shifted by the stream's shift ``f`` (video 12, audio
  3), ``dt = diff(1 - f g / (1 + (f - 1) g))[start:stop]`` and ``w = dt / sum(dt)``;
- the head is ``W = W_0 + sum_{j = max(start, 1)}^{stop - 1} w[j - start] W_j`` (bias likewise):
  head 0 always enters with weight 1, its own share is not added again.

The sigma reaches the head as the sampler hands it to the model (``timestep = sigma * 1000`` in
fp32, divided back, clamped at 1e-6), so the span is computed in the same fp32 steps.

``shifted_schedule(steps)`` is the sampler's "simple" schedule of a flow model with shift 12: the
unshifted grid ``u_k = 1 - k / steps`` mapped through ``12 u / (1 + 11 u)`` (fp32), then 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h3quant.errors import VerifyError

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0
SIGMA_MIN = 1e-6
MAX_STEPS = 1000


def shifted_schedule(steps: int, shift: float = VIDEO_SHIFT) -> list[float]:
    """``steps + 1`` sigmas from 1 down to 0 (see the module docstring)."""
    if not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise VerifyError(f"steps must be in 1..{MAX_STEPS}, got {steps!r}")
    u = torch.tensor([1.0 - k / steps for k in range(steps)], dtype=torch.float32)
    s = shift * u / (1.0 + (shift - 1.0) * u)
    return [float(v) for v in s] + [0.0]


def check_schedule(sigmas: Sequence[float]) -> list[float]:
    """A schedule as floats: at least two entries, finite, in [0, 1], non-increasing."""
    try:
        out = [float(s) for s in sigmas]
    except (TypeError, ValueError) as e:
        raise VerifyError(f"sigmas must be numbers: {e}") from None
    if len(out) < 2:
        raise VerifyError(f"a schedule needs at least 2 sigmas (one step), got {len(out)}")
    bad = [s for s in out if not math.isfinite(s) or not 0.0 <= s <= 1.0]
    if bad:
        raise VerifyError(f"sigmas must lie in [0, 1], got {bad[0]!r}")
    if any(b > a for a, b in zip(out, out[1:])):
        raise VerifyError(f"sigmas must not increase: {out}")
    return out


def model_sigma(sigma: float) -> torch.Tensor:
    """The sigma as the model sees it: ``(fp32(sigma) * 1000) / 1000``, clamped at 1e-6."""
    s = torch.tensor(float(sigma), dtype=torch.float32)
    return ((s * 1000.0) / 1000.0).clamp(min=SIGMA_MIN)


@dataclass(frozen=True)
class HeadSpan:
    """Which heads of an ``n``-head bank one step uses: ``start`` (inclusive) .. ``stop``."""

    heads: int
    step: int
    start: int
    stop: int

    def weights(self, flow_shift: float) -> torch.Tensor:
        """fp32 weights of heads ``start..stop-1`` (they sum to 1)."""
        n = self.heads
        g = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
        dt = (1.0 - flow_shift * g / (1.0 + (flow_shift - 1.0) * g)).diff()[self.start:self.stop]
        return (dt / dt.sum()).to(torch.float32)

    def combine(self, weight: torch.Tensor, bias: torch.Tensor, width: int,
                flow_shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's fp32 head ``(W [width, K], b [width])`` from a bank ``[n * width, K]``."""
        n = self.heads
        w = weight.to(torch.float32).reshape(n, width, weight.shape[-1])
        b = bias.to(torch.float32).reshape(n, width)
        first = max(self.start, 1)
        if first >= self.stop:
            return w[0].clone(), b[0].clone()
        share = self.weights(flow_shift)[first - self.start:]
        return (w[0] + torch.einsum("n,noi->oi", share, w[first:self.stop]),
                b[0] + torch.einsum("n,no->o", share, b[first:self.stop]))


def head_span(heads: int, sigma: float, sigmas: Sequence[float],
              shift: float = VIDEO_SHIFT) -> HeadSpan:
    """The span of the step at ``sigma`` of ``sigmas`` (see the module docstring)."""
    sched = torch.tensor(check_schedule(sigmas), dtype=torch.float32)
    s = model_sigma(sigma)
    i = int((sched - s).abs().argmin())
    nxt = sched[min(i + 1, sched.shape[0] - 1)]

    def pos(v: torch.Tensor) -> int:
        base = v / (shift + v * (1.0 - shift))
        return round(float(1.0 - base) * heads)

    start = min(pos(s), heads - 1)
    stop = max(pos(nxt), start + 1)
    return HeadSpan(heads, i, start, stop)
