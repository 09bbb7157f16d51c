"""Which format's limits an int8 layer is judged by: its own, or W4A8's when it came from W4A8.

An int8 layer converted from a W4A8 layer holds W4A8's decoded int8 grid (or a re-encoding of
W4A8's decoded weights): against the float original it carries W4A8's error, so int8's limits
would fail a file that is exactly what it should be. Such a layer is judged by W4A8's limits
when either

- the header says so: its name is listed in ``h3quant.from_w4a8`` (written by ``convert``), or
- its data says so: it is a ConvRot int8 layer and its sampled rows (``SAMPLE_ROWS`` rows, their
  first ``SAMPLE_COLS`` codes) lie on W4A8's decoded grid, as W4A8's codec tells
  (``codec.grid.grid_origin``, found through the registry).

Everything else (a float layer, a W4A8 layer, an int8 layer made from floats) is judged as
stored. The rule is in docs/verify.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3quant.formats import registry
from h3quant.h3 import provenance as origin

W4A8 = origin.W4A8
SAMPLE_ROWS = 256  # rows the grid test reads per layer (evenly spaced) ...
SAMPLE_COLS = 1024  # ... and codes of each (64 groups of W4A8's 16)
REASON_HEADER = "header says converted from W4A8"
REASON_GRID = "rows on a W4A8 grid"


@dataclass(frozen=True)
class Judgement:
    layer: str
    stored: str  # the stored format
    judged_as: str  # the format whose limits apply
    reason: str = ""  # why judged_as differs from stored ("" when it does not)


def grid_origin(q: torch.Tensor) -> str | None:
    """The W4A8 grid int8 codes ``q`` [n, K] lie on (its codec's description), or None."""
    codec = registry.get(W4A8)
    return codec.grid.grid_origin(q) if codec is not None else None


def sampled_grid_origin(q: torch.Tensor) -> str | None:
    """``grid_origin`` of a layer's codes, read from its sampled rows only."""
    return grid_origin(_sampled_rows(q))


def _sampled_rows(q: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLE_ROWS evenly spaced rows, their first SAMPLE_COLS codes: a slab of a few
    pages of the mapped file in either layout ([N, K], or [K, N] stored for the kn layout)."""
    step = max(1, -(-q.shape[0] // SAMPLE_ROWS))
    return q[::step, :SAMPLE_COLS].contiguous()


def judge(layer, from_header: set[str]) -> Judgement:
    """How one loaded layer (``runtime.loader.LoadedLayer``) is judged."""
    stored = layer.fields["format"] if layer.fields else "float"
    if not origin.is_int8(stored):
        return Judgement(layer.name, stored, stored)
    if layer.name in from_header:
        return Judgement(layer.name, stored, W4A8, REASON_HEADER)
    if layer.convrot:
        q, _ = layer.int8_grid()
        grid = sampled_grid_origin(q)
        if grid is not None:
            return Judgement(layer.name, stored, W4A8, f"{REASON_GRID} ({grid})")
    return Judgement(layer.name, stored, stored)


def header_set(ckpt, key: str = origin.KEY) -> set[str]:
    """The layers a checkpoint's header records under ``key`` (any shard): converted from
    W4A8, by default."""
    return set().union(*(origin.read(sf.metadata, key) for sf in ckpt.files))


def scaled_layers(ckpt) -> dict[str, str]:
    """The layers a checkpoint's header records as stored with AWQ channel scaling (any
    shard), each with the layer that carries the division."""
    out: dict[str, str] = {}
    for sf in ckpt.files:
        out.update(origin.read_scaling(sf.metadata))
    return out


def judge_checkpoint(ckpt, scan, prefixes: tuple[str, ...], *, first: bool = False
                     ) -> dict[str, Judgement]:
    """Judge the quantized layers whose names start with one of ``prefixes``. ``first``: stop
    at the first layer judged as W4A8 (a whole-model limit needs only one)."""
    from h3quant.runtime.loader import load_layer

    marks = header_set(ckpt)
    out: dict[str, Judgement] = {}
    for name, lay in scan.layers.items():
        if lay.fields is None or not name.startswith(prefixes):
            continue
        if not origin.is_int8(lay.fields["format"]):
            out[name] = Judgement(name, lay.fields["format"], lay.fields["format"])
            continue
        j = judge(load_layer(ckpt, lay), marks)
        for info in lay.tensors.values():  # keep RSS flat: drop the sampled pages
            ckpt.file_of(info.name).release_pages(info)
        out[name] = j
        if first and j.reason:
            break
    return out


def judged_formats(judgements, formats) -> list[str]:
    """``formats`` plus W4A8 when any layer is judged as W4A8 (the limits' input)."""
    extra = [W4A8] if any(j.judged_as == W4A8 for j in judgements) else []
    return sorted(set(formats) | set(extra))


def notes(judged: dict[str, dict], *, first: bool = False) -> list[str]:
    """One report line per reason: which layers are judged as W4A8 and why (``judged``: the
    ``to_json`` form; ``first``: the search stopped at the first such layer)."""
    by: dict[str, list[str]] = {}
    for name, j in judged.items():
        by.setdefault(j["reason"], []).append(name)
    return [f"judged as W4A8 (W4A8's limits): {reason}: {len(names)} int8 layer(s): "
            + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            + (" (the first found: one sets the whole model's limit)" if first else "")
            for reason, names in by.items()]


def to_json(judgements) -> dict[str, dict]:
    return {j.layer: {"stored": j.stored, "judged_as": j.judged_as, "reason": j.reason}
            for j in judgements if j.reason}
