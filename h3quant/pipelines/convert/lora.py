"""Merge LoRA adapters into float weights: ``W + strength * (alpha / rank) * B @ A``.

A LoRA file is read once (``load``); ``LoraSet.merged(layer, weight, dtype)`` adds every adapter
that targets ``layer`` (in the order the files were given, then key order) to the float weight
before any rotation or encoding. The sum is formed in float64 a block of rows at a time and
rounded once to the layer's stored dtype, so the result does not depend on the summation order
of a float32 matmul and memory stays at one block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3quant.errors import ConvertError, H3QuantError, LoraError
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.h3 import lora as lora_keys

MERGE_ROWS = 1024  # rows of a layer merged at once (float64: 44 MB at K = 5376)


def parse_spec(spec: str) -> tuple[str, float]:
    """``FILE[:STRENGTH]`` -> (path, strength); strength defaults to 1.0 and may be negative."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0


@dataclass(frozen=True)
class Entry:
    target: lora_keys.Target
    strength: float
    down: torch.Tensor  # A [rank, K], as stored
    up: torch.Tensor  # B [rows, rank], as stored
    scale: float  # alpha / rank
    file: str


@dataclass
class LoraSet:
    """Adapters of one or more LoRA files, resolved against one base."""

    entries: list[Entry] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    files: list[tuple[str, float]] = field(default_factory=list)

    @property
    def layers(self) -> set[str]:
        return {e.target.layer for e in self.entries}

    def on(self, layer: str) -> list[Entry]:
        return [e for e in self.entries if e.target.layer == layer]

    def delta_rows(self, layer: str, r0: int, r1: int, k: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of the layer's summed delta, float64."""
        out = torch.zeros((r1 - r0, k), dtype=torch.float64)
        for e in self.on(layer):
            t = e.target
            lo, hi = max(r0, t.row0), min(r1, t.row0 + t.rows)
            if lo >= hi:
                continue
            idx = torch.arange(lo - t.row0, hi - t.row0)
            if t.swap:  # adapter rows are [value; gate]; the layer's are [gate | up]
                idx = (idx + t.rows // 2) % t.rows
            up = e.up.to(torch.float64)[idx]
            out[lo - r0:hi - r0] += (e.strength * e.scale) * (up @ e.down.to(torch.float64))
        return out

    def merged(self, layer: str, weight: torch.Tensor, dtype: torch.dtype,
               done=None) -> torch.Tensor:
        """``weight`` [N, K] (float) with every adapter on ``layer`` added, rounded once to
        ``dtype``; ``done(r0, r1)`` is called once rows ``[r0, r1)`` of ``weight`` are used (a
        memory-mapped source drops its pages there)."""
        n, k = weight.shape
        out = torch.empty((n, k), dtype=dtype)
        for r0 in range(0, n, MERGE_ROWS):
            r1 = min(n, r0 + MERGE_ROWS)
            rows = weight[r0:r1].to(torch.float64) + self.delta_rows(layer, r0, r1, k)
            out[r0:r1] = rows.to(dtype)
            if done is not None:
                done(r0, r1)
        return out


def load(specs: list[str] | tuple[str, ...], base_shapes: dict[str, tuple[int, ...]],
         skip_unmatched: bool = False) -> LoraSet:
    """Read each ``FILE[:STRENGTH]`` once and resolve it against ``base_shapes`` (logical
    ``name -> shape`` of the base, ComfyUI names). Errors name the file and the keys."""
    out = LoraSet()
    for spec in specs:
        path, strength = parse_spec(spec)
        if not Path(path).is_file():
            raise ConvertError(f"--lora {spec}: no such file '{path}'")
        try:
            with SafetensorsFile(path, mmap=False) as f:  # read once, whole (LoRAs are small)
                tensors = {k: f.read(info).clone() for k, info in f.tensors.items()}
        except H3QuantError as exc:
            raise LoraError(f"LoRA '{path}': cannot read as safetensors ({exc.reason})") from None
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        adapters = lora_keys.parse(shapes, source=f"LoRA '{path}'")
        targets, skipped = lora_keys.resolve(adapters, base_shapes, f"LoRA '{path}'",
                                             skip_unmatched)
        lora_keys.check_shapes(targets, shapes, base_shapes, f"LoRA '{path}'")
        out.skipped += [f"{path}: {s}" for s in skipped]
        out.files.append((path, strength))
        for t in targets:
            ad = t.adapter
            alpha = float(tensors[ad.alpha].double().reshape(-1)[0]) if ad.alpha else float(ad.rank)
            down, up = tensors[ad.down], tensors[ad.up]
            if not (down.is_floating_point() and up.is_floating_point()):
                raise LoraError(f"LoRA '{path}': '{ad.down}' / '{ad.up}' are not float "
                                       "tensors")
            if not (torch.isfinite(down).all() and torch.isfinite(up).all()
                    and abs(alpha) < float("inf")):
                raise LoraError(f"LoRA '{path}': adapter '{ad.module}' holds non-finite "
                                       "values")
            out.entries.append(Entry(t, strength, down, up, alpha / ad.rank, path))
    return out
