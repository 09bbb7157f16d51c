"""Record the H3 diffusion model's inputs while a sampler runs, as ``--inputs`` files.

    rec = InputsRecorder("calib_inputs/", max_calls=64)
    model = rec.wrap(model)              # any callable with ComfyUI's H3 call signature
    ... run the sampler ...              # calib_inputs/run_<time>/call_00000.safetensors, ...

ComfyUI's MiniMax H3 diffusion model is called as ``forward(x, timestep, context,
transformer_options, minimax_payload=..., denoise_mask=..., audio_denoise_mask=..., **kwargs)``
with ``x = [video, audio]`` (latents ``[1, C, T, H, W]`` and ``[1, C, 2, Ta]``), ``timestep`` the
sampler's sigma times 1000 and ``context`` the text states ``[1, L, D]``. ``wrap(fn)`` records
every call and then calls ``fn``; ``diffusion_model_wrapper`` is the same for ComfyUI's
``WrappersMP.DIFFUSION_MODEL`` wrapper chain (``executor`` first), where the audio latent is
already the stream's own (ComfyUI undoes the sampler's audio scale before it).

Each call becomes one safetensors file: ``video``, ``audio``, ``text`` (stored in their dtypes)
and ``sigma`` (F32 [1]), the file ``capture --inputs``, ``plan --inputs`` and ``verify --model
--inputs`` read, and every other argument the call received (``record_extras``): each tensor
of ``minimax_payload`` (condition latents, text token tags), of the masks and other keyword
arguments and of ``transformer_options`` as an ``extra.*`` tensor, every plain value (numbers,
strings, lists, the sigma shifts) in the ``h3quant.call`` metadata, and the names of what is
not data in ``dropped`` with the reason (``DROPPED``: code such as patches, wrappers and
callbacks; the packed layout, which ComfyUI rebuilds from the sizes, keyframes and refs; a
cache of the tags). h3quant's forward reads only the four inputs: see docs/calibration.md for
what that leaves out of the statistics.

Every recorder writes into a folder of its own, ``run_<UTC time>`` (``_2``, ``_3``, ... when
that exists) under the folder it is given, created on the first call; files are numbered from
0 in it and never replace a file. Recording is bounded: it stops (and says so once) after
``max_calls`` files or when the next file would take the total past ``max_bytes``; the model
keeps running. A call with a batch other than 1 (ComfyUI's H3 supports batch 1 only) or sizes
an inputs file cannot hold is skipped with a note.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

MAX_CALLS = 256
MAX_BYTES = 16 << 30
META_KEY = "h3quant.call"  # the recorded call's plain values and what was dropped
# arguments that are not data, with the reason they are not recorded
DROPPED = {
    "minimax_payload.layout": "the packed layout object, rebuilt by ComfyUI from the latent "
                              "sizes and the recorded keyframes and refs",
    "minimax_payload._text_token_tags_list": "a cache of text_token_tags, which is recorded",
}
_CODE = "not a tensor or a plain value (code, a model, a layout object)"
_TOP_OPTIONS = ("patches", "patches_replace", "wrappers", "callbacks")


def _plain(value):
    return value is None or isinstance(value, (bool, int, float, str))


def _flatten(name: str, value, tensors: dict, dropped: dict):
    """``value`` as JSON, its tensors moved to ``tensors`` (named ``extra.<name>``; the JSON
    holds ``{"tensor": name}``), anything else named in ``dropped`` with the reason."""
    if name in DROPPED:
        dropped[name] = DROPPED[name]
        return None
    if isinstance(value, torch.Tensor):
        key = f"extra.{name}"
        tensors[key] = value.detach().cpu().contiguous()
        return {"tensor": key}
    if _plain(value):
        if isinstance(value, float) and value != value:
            return "nan"
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                dropped[f"{name}.{k!r}"] = "a key that is not a string"
                continue
            out[k] = _flatten(f"{name}.{k}", v, tensors, dropped)
        return out
    if isinstance(value, (list, tuple)):
        return [_flatten(f"{name}.{i}", v, tensors, dropped) for i, v in enumerate(value)]
    dropped[name] = f"{_CODE}: {type(value).__name__}"
    return None


def record_extras(transformer_options, kwargs) -> tuple[dict, dict, dict]:
    """(the tensors, the plain values, the dropped names with reasons) of a call's arguments
    other than ``x``, ``timestep`` and ``context``."""
    tensors: dict = {}
    dropped: dict = {}
    values: dict = {}
    for k, v in kwargs.items():
        values[k] = _flatten(k, v, tensors, dropped)
    opts = {}
    for k, v in (transformer_options or {}).items():
        if k in _TOP_OPTIONS or callable(v):
            dropped[f"transformer_options.{k}"] = _CODE
            continue
        opts[k] = _flatten(f"transformer_options.{k}", v, tensors, dropped)
    values["transformer_options"] = opts
    return tensors, values, dropped


def write_inputs(path, video: torch.Tensor, audio: torch.Tensor, text: torch.Tensor,
                 sigma: float, metadata: dict[str, str] | None = None,
                 extras: dict[str, torch.Tensor] | None = None) -> int:
    """Write one inputs file atomically (``extras``: ``extra.*`` tensors kept beside the
    inputs); returns its size in bytes."""
    from h3quant.formats.container.writer import save_tensors

    tensors = {"video": video.detach().cpu().contiguous(), "audio": audio.detach().cpu().contiguous(),
               "text": text.detach().cpu().contiguous(),
               "sigma": torch.tensor([float(sigma)], dtype=torch.float32), **(extras or {})}
    layout = save_tensors(path, tensors, metadata)
    return layout.file_bytes


class InputsRecorder:
    """Writes every call's inputs to a new run folder under ``out_dir`` as
    ``{prefix}_{n:05d}.safetensors`` (see the module docstring)."""

    def __init__(self, out_dir, *, max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES,
                 prefix: str = "call", log=None):
        if not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls must be a positive int, got {max_calls!r}")
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.out_dir = Path(out_dir)
        self.run_dir: Path | None = None  # made on the first recorded call
        self.max_calls, self.max_bytes, self.prefix = max_calls, max_bytes, prefix
        self.log = log or (lambda msg: None)
        self.files: list[Path] = []
        self.bytes = 0
        self.skipped = 0
        self.stopped: str | None = None
        self._lock = threading.Lock()

    def _new_run(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("run_%Y%m%d-%H%M%S", time.gmtime())
        for n in range(1, 10_000):
            d = self.out_dir / (stamp if n == 1 else f"{stamp}_{n}")
            try:
                os.mkdir(d)  # exclusive: another recorder's folder is never reused
            except FileExistsError:
                continue
            self.log(f"h3quant recorder: recording into {d}")
            return d
        raise RuntimeError(f"no free run folder under {self.out_dir}")

    def record(self, x, timestep, context, transformer_options=None, **kwargs) -> Path | None:
        """Record one call (``x = [video, audio]`` and every other argument); the file
        written, or None."""
        with self._lock:
            if self.stopped is not None:
                return None
            why = _unfit(x, timestep, context)
            if why is not None:
                self.skipped += 1
                self.log(f"h3quant recorder: call skipped ({why})")
                return None
            video, audio = x[0], x[1]
            extras, values, dropped = record_extras(transformer_options, kwargs)
            size = sum(t.numel() * t.element_size()
                       for t in (video, audio, context, *extras.values())) + 8192
            if len(self.files) >= self.max_calls:
                self._stop(f"{self.max_calls} calls recorded (max_calls)")
                return None
            if self.bytes + size > self.max_bytes:
                self._stop(f"the next call would pass {self.max_bytes:,} bytes (max_bytes)")
                return None
            sigma = float(torch.as_tensor(timestep).detach().float().flatten()[0].cpu()) / 1000.0
            if self.run_dir is None:
                self.run_dir = self._new_run()
            path = self.run_dir / f"{self.prefix}_{len(self.files):05d}.safetensors"
            if path.exists():  # never replace a file
                self._stop(f"{path} exists")
                return None
            meta = {"call": str(len(self.files)), "timestep": repr(sigma * 1000),
                    META_KEY: json.dumps({"values": values, "dropped": dropped},
                                         sort_keys=True)}
            self.bytes += write_inputs(path, video, audio, context, sigma, meta, extras)
            self.files.append(path)
            return path

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.log(f"h3quant recorder: stopped recording: {why}; {len(self.files)} file(s) in "
                 f"{self.run_dir or self.out_dir}")
        return None

    def wrap(self, fn):
        """``fn`` with every call recorded first (ComfyUI's H3 call signature)."""
        def recorded(x, timestep, context, *args, **kwargs):
            self.record(x, timestep, context, *args[:1], **kwargs)
            return fn(x, timestep, context, *args, **kwargs)
        recorded.__wrapped__ = fn
        return recorded

    def diffusion_model_wrapper(self, executor, x, timestep, context, *args, **kwargs):
        """A ComfyUI ``WrappersMP.DIFFUSION_MODEL`` wrapper: record, then run the chain."""
        self.record(x, timestep, context, *args[:1], **kwargs)
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


__all__ = ["DROPPED", "MAX_BYTES", "MAX_CALLS", "META_KEY", "InputsRecorder", "record_extras",
           "write_inputs"]
