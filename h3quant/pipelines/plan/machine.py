"""``plan --device CLASS --vram SIZE``: which file fits a machine, from headers only.

The estimate of what ComfyUI holds in device memory while sampling:

- the DiT's weights, as stored (each candidate format's bytes come from its spec's tensor set at
  each block linear's [N, K]; every other tensor keeps its stored bytes);
- the activation working set of one block at the requested size: video tokens x (4 x hidden + 3
  x ffn) values in bf16 (the residual stream, the normed input, the fused gate and up rows and
  their product), with attention through a memory-efficient kernel (no tokens x tokens matrix);
- where the device dequantizes a format, one decoded layer's weight in bf16 (ComfyUI casts the
  weight of the layer that runs, one at a time);
- the text encoder's and the VAE's weights, when their files are named (ComfyUI loads them
  before and after the DiT; the peak here counts them resident, the worst case);
- a fixed reserve for the CUDA context and the allocator.

ComfyUI offloads what does not fit: weights stay in system RAM and stream to the device layer by
layer (slower); the plan says how much would stay out. Figures are estimates, not measurements.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from h3quant import device_profiles
from h3quant.errors import UsageError
from h3quant.sizes import size_text

# Assumptions, stated in every plan (not read from any file):
VAE_SPATIAL = 16  # pixels per latent pixel along each side
VAE_TEMPORAL = 4  # video frames per latent frame (after the first)
PATCH = 2  # latent pixels per patch along each side (H3's patch 1x2x2)
RESERVE = 1 << 30  # CUDA context, allocator slack, small buffers: 1 GiB
ACT_BYTES = 2  # bf16 activations
DEFAULT_RESOLUTION = (1344, 768)  # H3's native 16:9 canvas
DEFAULT_FRAMES = 121  # about 5 s at 24 fps

ASSUMPTIONS = (
    f"video tokens: {VAE_SPATIAL}x spatial and {VAE_TEMPORAL}x temporal VAE compression "
    f"(assumed), patches of {PATCH}x{PATCH} latent pixels; audio tokens left out (a few "
    "hundred)",
    "activations: one block's working set in bf16, attention by a memory-efficient kernel",
    "a format the device dequantizes adds one decoded layer in bf16 (ComfyUI casts per layer)",
    "text encoder and VAE counted only when named, as resident (ComfyUI may unload them)",
    "1 GiB reserved for the CUDA context and allocator",
    "ComfyUI offloads what does not fit: weights stay in system RAM and stream per layer, "
    "slower",
)


@dataclass
class Candidate:
    target: str  # the convert --to name
    format: str  # its wire name
    weights: int  # the DiT's bytes in this format
    total: int  # the estimate of device memory
    cell: str  # native / dequant / emulated / unverified on this device class
    fits: bool


@dataclass
class MachinePlan:
    path: str
    device_class: str
    label: str
    vram: int
    resolution: tuple[int, int]
    frames: int
    tokens: int
    activations: int
    extra: dict[str, int]  # text encoder, VAE: bytes
    current: dict  # the input as it is: {formats, weights, total, fits}
    candidates: list[Candidate]
    choice: str | None  # the target to convert to (None: the input fits, or nothing does)
    verdict: str
    suggestions: list[str] = field(default_factory=list)
    assumptions: tuple[str, ...] = ASSUMPTIONS

    def to_dict(self) -> dict:
        d = asdict(self)
        d["resolution"] = list(self.resolution)
        d["assumptions"] = list(self.assumptions)
        return d


def video_tokens(width: int, height: int, frames: int) -> int:
    """Video tokens of a WxH clip of ``frames`` frames (the assumed VAE and H3's patches)."""
    lat_t = 1 + (max(frames, 1) - 1) // VAE_TEMPORAL
    side = VAE_SPATIAL * PATCH
    return lat_t * math.ceil(height / side) * math.ceil(width / side)


def _layer_bytes(spec, n: int, k: int) -> int | None:
    """A layer's bytes in ``spec``'s format (its tensor set at [N, K], marker defaults), None
    when the format cannot hold that shape."""
    from h3quant.formats.container.dtypes import itemsize

    fields = dict(spec.storage.marker_defaults)
    total = 0
    for t in spec.storage.tensors:
        if not t.required or t.shapes is None:
            continue
        try:
            shapes = t.shapes(n, k, fields)
        except (KeyError, ZeroDivisionError, TypeError):
            return None
        if not shapes:
            return None
        total += math.prod(shapes[0]) * itemsize(t.dtypes[0])
    return total


def _file_bytes(path: str) -> int:
    """A named text encoder's or VAE's weight bytes (a checkpoint's tensor bytes, else the file's
    size)."""
    from h3quant.formats.container.checkpoint import Checkpoint

    try:
        with Checkpoint(path) as ck:
            return int(ck.total_bytes)
    except Exception:  # noqa: BLE001 - a GGUF or another container: its size on disk
        return os.path.getsize(path)


def plan_for_machine(src: str | os.PathLike, device: str, vram: int, *,
                     resolution: tuple[int, int] | None = None, frames: int | None = None,
                     text_encoder: str | None = None, vae: str | None = None,
                     any_format: bool = False, mmap: bool = True) -> MachinePlan:
    """The plan for ``src`` on a ``device`` class card with ``vram`` bytes (headers only)."""
    from h3quant.formats import registry
    from h3quant.pipelines.headers.inspect import inspect_checkpoint

    cls = device_profiles.device_class(device)
    if vram <= 0:
        raise UsageError("--vram must be positive")
    width, height = resolution or DEFAULT_RESOLUTION
    frames = frames or DEFAULT_FRAMES
    info = inspect_checkpoint(src, layers=True, mmap=mmap)
    topo = info.topology
    if not topo:
        raise UsageError(f"{src}: not a recognised H3 DiT (plan --device needs its topology)")
    block = [r for r in info.layers or [] if r["name"].startswith("blocks.")
             and r["N"] and r["K"]]
    block_bytes = sum(r["bytes"] for r in block)
    rest = info.total_bytes - block_bytes
    tokens = video_tokens(width, height, frames)
    acts = tokens * ACT_BYTES * (4 * topo["hidden"] + 3 * topo["ffn"])
    biggest = max((r["N"] * r["K"] for r in block), default=0) * ACT_BYTES
    extra = {}
    if text_encoder:
        extra["text_encoder"] = _file_bytes(text_encoder)
    if vae:
        extra["vae"] = _file_bytes(vae)
    fixed = acts + sum(extra.values()) + RESERVE

    def total(weights: int, cells: list[str]) -> int:
        dequant = any(c != "native" for c in cells)
        return weights + fixed + (biggest if dequant else 0)

    cur_formats = sorted({r["format"] for r in block})
    cur_specs = [registry.spec(f) for f in cur_formats]
    cur_cells = [device_profiles.cell(sp, cls) if sp is not None and sp.quantized else "native"
                 for sp in cur_specs]
    cur_total = total(info.total_bytes, cur_cells)
    current = {"formats": cur_formats, "weights": info.total_bytes, "total": cur_total,
               "fits": cur_total <= vram, "cells": cur_cells}

    cands = []
    for name, target in registry.targets().items():
        spec = registry.spec(target.codec)
        if spec is None or not spec.quantized or spec.layout != "canonical":
            continue
        sizes = [_layer_bytes(spec, r["N"], r["K"]) for r in block]
        if any(s is None for s in sizes):
            continue
        weights = rest + sum(s for s in sizes if s is not None)
        cell = device_profiles.cell(spec, cls)
        t = total(weights, [cell])
        cands.append(Candidate(name, spec.name, weights, t, cell, t <= vram))
    cands.sort(key=lambda c: -c.weights)
    usable = [c for c in cands if any_format or c.cell == "native"]
    suggestions: list[str] = []
    choice = None
    if current["fits"]:
        verdict = "already fits: nothing to convert, nothing written"
    else:
        fit = [c for c in usable if c.fits]
        if fit:
            choice = fit[0].target
            verdict = (f"convert --to {choice}: the most precise "
                       f"{'' if any_format else 'native '}format that fits")
        else:
            verdict = "out of reach at this size"
            smallest = min(usable or cands, key=lambda c: c.total, default=None)
            if smallest is not None:
                over = smallest.total - vram
                suggestions.append(f"the smallest {'native ' if usable else ''}format, "
                                   f"{smallest.target}, needs about {size_text(over)} more: "
                                   "ComfyUI would offload that much of the weights to system RAM "
                                   "(it streams them per layer: slower)")
            smaller = [c for c in cands if c not in usable and c.total < vram]
            if smaller and not any_format:
                suggestions.append("formats that fit but are dequantized on this device (slower, "
                                   "and the plan counts a decoded layer): "
                                   + ", ".join(c.target for c in smaller) + " (--any-format)")
            suggestions.append("or a lower --resolution / fewer --frames: activations are "
                               f"{size_text(acts)} at {width}x{height}, {frames} frames")
    return MachinePlan(str(src), cls.name, cls.label, vram, (width, height), frames, tokens,
                       acts, extra, current, cands, choice, verdict, suggestions)
