"""Record the H3 diffusion model's inputs while a sampler runs, as ``--inputs`` files.

    rec = InputsRecorder("calib_inputs/", max_calls=64)
    model = rec.wrap(model)              # any callable with ComfyUI's H3 call signature
    ... run the sampler ...              # each call appends one file: calib_inputs/call_00000...

ComfyUI's MiniMax H3 diffusion model is called as ``forward(x, timestep, context, ...)`` with
``x = [video, audio]`` (latents ``[1, C, T, H, W]`` and ``[1, C, 2, Ta]``), ``timestep`` the
sampler's sigma times 1000 and ``context`` the text states ``[1, L, D]``; the other arguments
(``transformer_options``, ``minimax_payload``, masks) are passed through untouched.
``wrap(fn)`` records every call and then calls ``fn``; ``diffusion_model_wrapper`` is the same
for ComfyUI's ``WrappersMP.DIFFUSION_MODEL`` wrapper chain (``executor`` first), where the audio
latent is already the stream's own (ComfyUI undoes the sampler's audio scale before it).

Each call becomes one safetensors file ``video``, ``audio``, ``text`` (stored in their dtypes)
and ``sigma`` (F32 [1]), the file ``capture --inputs``, ``plan --inputs`` and ``verify --model
--inputs`` read. Recording is bounded: it stops (and says so once) after ``max_calls`` files or
when the next file would take the total past ``max_bytes``; the model keeps running. A call with
a batch other than 1 (ComfyUI's H3 supports batch 1 only) or sizes an inputs file cannot hold is
skipped with a note.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

MAX_CALLS = 256
MAX_BYTES = 16 << 30


def write_inputs(path, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor,
                 sigma: float, metadata: dict[str, str] | None = None) -> int:
    """Write one inputs file atomically; returns its size in bytes."""
    from h3quant.formats.container.writer import save_tensors

    tensors = {"video": video.detach().cpu().contiguous(), "audio": audio.detach().cpu().contiguous(),
               "text": text.detach().cpu().contiguous(),
               "sigma": torch.tensor([float(sigma)], dtype=torch.float32)}
    layout = save_tensors(path, tensors, metadata)
    return layout.file_bytes


class InputsRecorder:
    """Appends every call's inputs to ``out_dir`` as ``{prefix}_{n:05d}.safetensors``."""

    def __init__(self, out_dir, *, max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES,
                 prefix: str = "call", log=None):
        if not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls must be a positive int, got {max_calls!r}")
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.out_dir = Path(out_dir)
        self.max_calls, self.max_bytes, self.prefix = max_calls, max_bytes, prefix
        self.log = log or (lambda msg: None)
        self.files: list[Path] = []
        self.bytes = 0
        self.skipped = 0
        self.stopped: str | None = None
        self._lock = threading.Lock()

    def record(self, x, timestep, context) -> Path | None:
        """Record one call's inputs (``x = [video, audio]``); the file written, or None."""
        with self._lock:
            if self.stopped is not None:
                return None
            why = _unfit(x, timestep, context)
            if why is not None:
                self.skipped += 1
                self.log(f"h3quant recorder: call skipped ({why})")
                return None
            video, audio = x[0], x[1]
            size = sum(t.numel() * t.element_size() for t in (video, audio, context)) + 4096
            if len(self.files) >= self.max_calls:
                self._stop(f"{self.max_calls} calls recorded (max_calls)")
                return None
            if self.bytes + size > self.max_bytes:
                self._stop(f"the next call would pass {self.max_bytes:,} bytes (max_bytes)")
                return None
            sigma = float(torch.as_tensor(timestep).detach().float().flatten()[0].cpu()) / 1000.0
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"{self.prefix}_{len(self.files):05d}.safetensors"
            self.bytes += write_inputs(path, video, audio, context, sigma,
                                       {"call": str(len(self.files)), "timestep": repr(sigma * 1000)})
            self.files.append(path)
            return path

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.log(f"h3quant recorder: stopped recording: {why}; {len(self.files)} file(s) in "
                 f"{self.out_dir}")
        return None

    def wrap(self, fn):
        """``fn`` with every call recorded first (ComfyUI's H3 call signature)."""
        def recorded(x, timestep, context, *args, **kwargs):
            self.record(x, timestep, context)
            return fn(x, timestep, context, *args, **kwargs)
        recorded.__wrapped__ = fn
        return recorded

    def diffusion_model_wrapper(self, executor, x, timestep, context, *args, **kwargs):
        """A ComfyUI ``WrappersMP.DIFFUSION_MODEL`` wrapper: record, then run the chain."""
        self.record(x, timestep, context)
        return executor(x, timestep, context, *args, **kwargs)


def _unfit(x, timestep, context) -> str | None:
    if not isinstance(x, (list, tuple)) or len(x) != 2:
        return "x is not [video, audio]"
    video, audio = x
    for name, t, nd in (("video", video, 5), ("audio", audio, 4), ("context", context, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd or not t.is_floating_point():
            return f"{name} is not a {nd}-D float tensor"
        if t.shape[0] != 1:
            return f"{name} has batch {t.shape[0]}; inputs files hold batch 1"
    if audio.shape[2] != 2:
        return "audio is not stereo [1, C, 2, Ta]"
    t = torch.as_tensor(timestep)
    if t.numel() < 1 or not bool(torch.isfinite(t.float()).all()):
        return "timestep is empty or not finite"
    sigma = float(t.float().flatten()[0]) / 1000.0
    if not 0.0 < sigma <= 1.0:
        return f"sigma {sigma} is outside (0, 1]"
    return None


__all__ = ["MAX_BYTES", "MAX_CALLS", "InputsRecorder", "write_inputs"]
