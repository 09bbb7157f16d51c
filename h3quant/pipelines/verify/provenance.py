"""Which format's limits an int8 layer is judged by: its own, or W4A8's when it came from W4A8.

An int8 layer converted from a W4A8 layer holds W4A8's decoded int8 grid (or a re-encoding of
W4A8's decoded weights): against the float original it carries W4A8's error, so int8's limits
would fail a file that is exactly what it should be. Such a layer is judged by W4A8's limits
when either

- the header says so: its name is listed in ``h3quant.from_w4a8`` (written by ``convert``), or
- its data says so: it is a ConvRot int8 layer and every group of ``GROUP`` codes of the
  sampled rows (``SAMPLE_ROWS`` rows, their first ``SAMPLE_COLS`` codes) is
  ``clamp(round(level * s), -127, 127)`` for one positive e4m3 ``s`` and a 16-level table
  shared by the layer (W4A8's frozen Lloyd-Max table or the uniform ``code - 8`` table; a
  fitted table is not recognised from the data, only from the header).

Everything else (a float layer, a W4A8 layer, an int8 layer made from floats) is judged as
stored. The rule is in docs/verify.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3quant.formats.w4a8.codebook import FROZEN_CODEBOOK
from h3quant.h3 import provenance as origin

W4A8 = origin.W4A8
GROUP = 16  # W4A8's group of codes sharing one e4m3 scale (the group size h3quant writes)
SAMPLE_ROWS = 256  # rows the grid test reads per layer (evenly spaced) ...
SAMPLE_COLS = 1024  # ... and codes of each (64 groups of 16)
REASON_HEADER = "header says converted from W4A8"
REASON_GRID = "rows on a W4A8 grid"


@dataclass(frozen=True)
class Judgement:
    layer: str
    stored: str  # the stored format
    judged_as: str  # the format whose limits apply
    reason: str = ""  # why judged_as differs from stored ("" when it does not)


def _tables() -> dict[str, torch.Tensor]:
    return {"frozen Lloyd-Max": FROZEN_CODEBOOK.float(),
            "uniform": torch.arange(-8, 8, dtype=torch.float32)}


def _e4m3_positive() -> torch.Tensor:
    """Every positive finite e4m3 value (bit patterns 0x01..0x7E)."""
    return torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _membership(table: torch.Tensor) -> torch.Tensor:
    """[S, 255] bool: code v (+127) is a level of the grid of scale number s."""
    s = _e4m3_positive()
    grid = (table[None, :] * s[:, None]).round().clamp(-127, 127).long() + 127  # as decode does
    member = torch.zeros(s.numel(), 255, dtype=torch.bool)
    member.scatter_(1, grid, True)
    return member


def grid_table(q: torch.Tensor, group: int = GROUP) -> str | None:
    """The name of the W4A8 level table every group of ``q`` [n, K] sits on, or None. An
    all-zero ``q`` is on no grid (nothing to tell)."""
    if q.dim() != 2 or q.shape[1] % group or not q.numel() or not bool(q.any()):
        return None
    for name, table in _tables().items():
        member = _membership(table)
        g = q.reshape(-1, group).long() + 127
        # chunk by chunk, stopping at the first group off the grid (int8 from floats: at once)
        if all(bool(member[:, g[i:i + 512]].all(-1).any(0).all()) for i in range(0, g.shape[0], 512)):
            return name
    return None


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
        table = grid_table(_sampled_rows(q))
        if table is not None:
            return Judgement(layer.name, stored, W4A8,
                             f"{REASON_GRID} ({table} levels, groups of {GROUP})")
    return Judgement(layer.name, stored, stored)


def header_set(ckpt) -> set[str]:
    """The layers a checkpoint's header records as converted from W4A8 (any shard)."""
    return set().union(*(origin.read(sf.metadata) for sf in ckpt.files))


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
