"""The flow-matching Euler sampler of a card's sampling run.

The video stream follows ComfyUI's ``sample_euler`` with a flow model (``CONST``): at step
``i`` the model's output ``out`` gives ``denoised = x - out * sigma``, the derivative
``d = (x - denoised) / sigma`` and ``x <- x + d * (sigma_next - sigma)``, all in fp32 with the
schedule an fp32 tensor. The audio stream steps along its own schedule (the video sigma shifted
from 12 to 3): the continuous-time equivalent of ComfyUI's audio carried on the video schedule.
The initial latent is ``sigma_0 * noise`` (an empty latent), per stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from h3quant import device_kinds
from h3quant.runtime.model.schedule import AUDIO_SHIFT, VIDEO_SHIFT, schedule_tensor, time_shift


def audio_sigmas(sched: torch.Tensor) -> torch.Tensor:
    """The audio stream's fp32 schedule."""
    return time_shift(sched, VIDEO_SHIFT, AUDIO_SHIFT)


def sync(device) -> None:
    """Wait for the device's queued work (for timing), as its kind's record says."""
    device_kinds.kind(getattr(device, "type", str(device)).split(":")[0]).sync()


def euler(model, noise_video: torch.Tensor, noise_audio: torch.Tensor, text: torch.Tensor,
          sigmas, dtype: torch.dtype,
          on_step: Callable[[int, torch.Tensor, torch.Tensor, float], None] | None = None,
          steps: int | None = None):
    """Run the sampler (``steps``: only the first N steps); returns the final fp32 CPU
    latents ``(video, audio)``. ``on_step(i, video, audio, seconds)`` after every step."""
    sched = schedule_tensor(sigmas)
    sa = audio_sigmas(sched)
    xv = sched[0] * noise_video.float()
    xa = sa[0] * noise_audio.float()
    sig = [float(s) for s in sched]
    n = len(sig) - 1 if steps is None else min(steps, len(sig) - 1)
    for i in range(n):
        t0 = time.perf_counter()
        out_v, out_a = model(xv.to(dtype), xa.to(dtype), text.to(dtype), sigmas=sig, step=i)
        sync(getattr(model, "tdev", "cpu"))
        seconds = time.perf_counter() - t0
        s = sched[i]
        denoised = xv - out_v.float().cpu() * s
        d = (xv - denoised) / s
        xv = xv + d * (sched[i + 1] - s)
        xa = xa + out_a.float().cpu() * (sa[i + 1] - sa[i])
        if on_step is not None:
            on_step(i, xv, xa, seconds)
    return xv, xa
