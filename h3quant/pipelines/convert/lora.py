"""Merge LoRA adapters into float weights: ``W + strength * (alpha / rank) * B @ A``.

A LoRA file is read once (``load``); ``LoraSet.merged(layer, weight, dtype)`` adds every adapter
that targets ``layer`` (in the order the files were given, then key order) to the float weight
before any rotation or encoding, in ComfyUI's own arithmetic (fp32 ``up @ down``, scaled,
added to the fp32 weight, rounded once to the stored dtype), a block of rows at a time so
memory stays at one block of rows. ``delta_rows`` (float64) serves the survival report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3quant.errors import ConvertError, H3QuantError, LoraError
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.h3 import lora as lora_keys
from h3quant.pipelines.convert.options import parse_lora_spec as parse_spec  # noqa: F401

_ADAPTER_DTYPES = ("F32", "F16", "BF16", "F64")  # an fp8 adapter is refused from its header
_ALPHA_DTYPES = _ADAPTER_DTYPES + ("I64", "I32", "I16", "I8", "U8")


MERGE_ROWS = 1024  # rows of a layer merged at once (fp32: 22 MB at K = 5376)


def check_spec(spec: str) -> tuple[str, float]:
    """``FILE[:STRENGTH]`` checked: (path, strength), or a ``ConvertError`` that says which
    part is wrong (a strength that is no number, a directory, a missing file)."""
    path, strength = parse_spec(spec)
    p = Path(path)
    if not p.exists():
        head, sep, tail = spec.rpartition(":")
        if sep and head and Path(head).exists():
            raise ConvertError(f"--lora {spec}: strength '{tail}' is not a number (write "
                               f"FILE[:STRENGTH], e.g. --lora {head}:0.8)")
        raise ConvertError(f"--lora {spec}: no such file '{path}'")
    if p.is_dir():
        raise ConvertError(f"--lora {spec}: '{path}' is a directory; name the LoRA "
                           ".safetensors file inside it")
    if not p.is_file():
        raise ConvertError(f"--lora {spec}: '{path}' is not a regular file")
    if strength != strength or strength in (float("inf"), float("-inf")):
        raise ConvertError(f"--lora {spec}: strength must be a finite number")
    return path, strength


def _fitting(targets, shapes: dict, base_shapes: dict):
    """(targets whose A and B fit their layer, "module: why" for the others)."""
    keep, misfit = [], []
    for t in targets:
        k = tuple(base_shapes[t.layer + ".weight"])[1]
        down, up = tuple(shapes[t.adapter.down]), tuple(shapes[t.adapter.up])
        if down[1:2] == (k,) and up[:1] == (t.rows,):
            keep.append(t)
        else:
            misfit.append(f"'{t.adapter.module}' down {list(down)} up {list(up)} does not fit "
                          f"'{t.layer}' ({t.rows} rows, K={k})")
    return keep, misfit


def _fit_hint(adapters, shapes: dict, base_shapes: dict) -> str:
    """Which H3 preset the LoRA's shapes fit, against the base's, and the way out."""
    from collections import Counter

    from h3quant.h3.topology import PRESETS

    def preset_of(dims: Counter) -> str | None:
        hits = [(dims[c.hidden], name, c.hidden) for name, c in PRESETS.items() if dims[c.hidden]]
        return f"'{max(hits)[1]}' (hidden {max(hits)[2]})" if hits else None

    lora_dims = Counter(d for a in adapters for d in shapes[a.down][1:2] + shapes[a.up][:1])
    base_dims = Counter(d for n, s in base_shapes.items() if n.endswith(".weight") and len(s) == 2
                        for d in s)
    mine, base = preset_of(lora_dims), preset_of(base_dims)
    hint = ""
    if mine and base and mine != base:
        hint = f". This LoRA fits the H3 {mine} preset; the base is {base}"
    return hint + ". --lora-skip-unmatched bakes the adapters that fit and lists the others"


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
        ``dtype``, in ComfyUI's arithmetic (``comfy/weight_adapter/lora.py``, applied by its
        model patcher to an fp32 copy of the weight): per adapter, in order, ``up @ down`` in
        fp32, times ``strength * alpha / rank`` (a Python float, so the product is rounded to
        fp32 once), added to the fp32 weight; the sum is rounded once to ``dtype``. A bake
        therefore equals what ComfyUI computes when it applies the LoRA at load time, bit for
        bit. ``done(r0, r1)`` is called once rows ``[r0, r1)`` of ``weight`` are used (a
        memory-mapped source drops its pages there)."""
        n, k = weight.shape
        out = torch.empty((n, k), dtype=dtype)
        entries = self.on(layer)
        for r0 in range(0, n, MERGE_ROWS):
            r1 = min(n, r0 + MERGE_ROWS)
            rows = weight[r0:r1].to(torch.float32, copy=True)
            for e in entries:
                t = e.target
                lo, hi = max(r0, t.row0), min(r1, t.row0 + t.rows)
                if lo >= hi:
                    continue
                idx = torch.arange(lo - t.row0, hi - t.row0)
                if t.swap:  # adapter rows are [value; gate]; the layer's are [gate | up]
                    idx = (idx + t.rows // 2) % t.rows
                diff = torch.mm(e.up.to(torch.float32)[idx], e.down.to(torch.float32))
                rows[lo - r0:hi - r0] += (e.strength * e.scale) * diff
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
        path, strength = check_spec(spec)
        try:
            fh = SafetensorsFile(path, mmap=False)
        except H3QuantError as exc:
            raise LoraError(f"LoRA '{path}': cannot read as safetensors ({exc.reason})") from None
        with fh as f:  # the header first: every key, rank and shape checked before any data
            infos = dict(f.tensors)
            shapes = {k: tuple(v.shape) for k, v in infos.items()}
            adapters = lora_keys.parse(shapes, source=f"LoRA '{path}'")
            try:
                targets, skipped = lora_keys.resolve(adapters, base_shapes, f"LoRA '{path}'",
                                                     skip_unmatched)
                if skip_unmatched:
                    targets, misfit = _fitting(targets, shapes, base_shapes)
                    skipped += misfit
                lora_keys.check_shapes(targets, shapes, base_shapes, f"LoRA '{path}'")
            except LoraError as exc:
                raise LoraError(f"{exc.reason}{_fit_hint(adapters, shapes, base_shapes)}") from None
            for t in targets:
                ad = t.adapter
                for key in (ad.down, ad.up):
                    if infos[key].dtype not in _ADAPTER_DTYPES:
                        raise LoraError(f"LoRA '{path}': '{key}' is stored as "
                                        f"{infos[key].dtype}; adapters are baked from "
                                        f"{', '.join(_ADAPTER_DTYPES)} tensors")
                if ad.alpha and infos[ad.alpha].dtype not in _ALPHA_DTYPES:
                    raise LoraError(f"LoRA '{path}': '{ad.alpha}' is stored as "
                                    f"{infos[ad.alpha].dtype}; alpha must be a float or "
                                    "integer scalar")
            # only the tensors of the adapters used are read (bounded by rank x layer width)
            wanted = {k for t in targets for k in (t.adapter.down, t.adapter.up, t.adapter.alpha)
                      if k}
            tensors = {k: f.read(infos[k]).clone() for k in sorted(wanted)}
        out.skipped += [f"{path}: {s}" for s in skipped]
        out.files.append((path, strength))
        for t in targets:
            ad = t.adapter
            alpha = float(tensors[ad.alpha].double().reshape(-1)[0]) if ad.alpha else float(ad.rank)
            down, up = tensors[ad.down], tensors[ad.up]
            if not (torch.isfinite(down).all() and torch.isfinite(up).all()
                    and abs(alpha) < float("inf")):
                raise LoraError(f"LoRA '{path}': adapter '{ad.module}' holds non-finite "
                                       "values")
            out.entries.append(Entry(t, strength, down, up, alpha / ad.rank, path))
    return out
