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

Every quantity follows ComfyUI's own arithmetic, dtype and order (``comfy/ldm/minimax/model.py``,
``comfy/samplers.py``, ``comfy/model_sampling.py``), because a position that lands on a
rounding tie (e.g. exactly 2.5 on a 4-head bank) picks a different head in fp32 than in float64:

- the schedule is an fp32 tensor (``torch.FloatTensor`` of the sampler's sigmas);
- the model's sigma: ``timestep = fp32(sigma) * 1000`` (fp32), then ``timestep / 1000`` (fp32),
  clamped at 1e-6, turned into a Python float (``model_sigma``);
- ``i = argmin |schedule - sigma|`` in fp32; ``next = schedule[i + 1]``, a 0-d fp32 tensor;
- ``start`` from the Python float sigma: ``base`` and ``1 - base`` in float64;
  ``stop`` from ``next``: ``base`` and ``1 - base`` in fp32; both turned into Python floats,
  multiplied by ``n`` in float64 and rounded by Python's ``round`` (ties to even).

``shifted_schedule(steps)`` is ComfyUI's "simple" scheduler of a flow model with shift 12: the
1000-entry table ``sigma_k = 12 t / (1 + 11 t)`` with ``t = ((k / 1000) * 1000) / 1000``
(``k = 1..1000``, fp32), read at ``-(1 + int(x * 1000 / steps))`` for ``x = 0..steps-1``,
then 0.
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


def time_shift(sigma, from_shift: float, to_shift: float):
    """Map a sigma of the schedule shifted by ``from_shift`` to the one shifted by ``to_shift``
    (ComfyUI's expression and order; a Python float stays float64, an fp32 tensor stays fp32)."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def sigma_table(shift: float = VIDEO_SHIFT, timesteps: int = 1000,
                multiplier: float = 1000.0) -> torch.Tensor:
    """The flow model's fp32 table of ``timesteps`` sigmas, lowest first (ComfyUI's
    ``ModelSamplingDiscreteFlow``)."""
    t = (torch.arange(1, timesteps + 1, 1) / timesteps) * multiplier
    t = t / multiplier
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def shifted_schedule(steps: int, shift: float = VIDEO_SHIFT) -> list[float]:
    """``steps + 1`` sigmas from 1 down to 0: ComfyUI's "simple" scheduler (module docstring)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise VerifyError(f"steps must be in 1..{MAX_STEPS}, got {steps!r}")
    table = sigma_table(shift)
    stride = len(table) / steps
    return [float(table[-(1 + int(x * stride))]) for x in range(steps)] + [0.0]


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


def model_sigma(sigma: float) -> float:
    """The sigma as the model sees it: ``float(((fp32(sigma) * 1000) / 1000).clamp(1e-6))``."""
    timestep = torch.tensor([float(sigma)], dtype=torch.float32) * 1000.0
    return float((timestep.flatten()[0] / 1000.0).float().clamp(min=SIGMA_MIN))


def schedule_tensor(sigmas: Sequence[float]) -> torch.Tensor:
    """The checked schedule as the sampler holds it: an fp32 tensor."""
    return torch.tensor(check_schedule(sigmas), dtype=torch.float32)


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
    """The span of the step at ``sigma`` of ``sigmas`` (module docstring: ComfyUI's arithmetic)."""
    sched = schedule_tensor(sigmas)
    s = model_sigma(sigma)  # a Python float
    i = int((sched - s).abs().argmin())
    nxt = sched[min(i + 1, sched.shape[0] - 1)]  # a 0-d fp32 tensor
    start, stop = (round(float(1.0 - time_shift(v, shift, 1.0)) * heads) for v in (s, nxt))
    start = min(start, heads - 1)
    stop = max(stop, start + 1)
    return HeadSpan(heads, i, start, stop)
