"""Telling int8 codes that lie on an ``asym_w4a8_int8`` decoded grid (verify's provenance).

W4A8 decodes a group of ``GROUP`` codes as ``clamp(round(level * s), -127, 127)`` for one
positive e4m3 scale ``s`` and a 16-level table shared by the layer. An int8 layer converted
from W4A8 through that grid keeps those codes exactly, so ``grid_table`` recognises it from its
data: every group of the codes must sit on the grid of some positive e4m3 scale of one table
(the frozen Lloyd-Max table or the uniform ``code - 8`` table; a fitted table is not recognised
from the data, only from the header). Imports torch: the codec imports this module on use.
"""

from __future__ import annotations

import torch

from h3quant.formats.w4a8.codebook import FROZEN_CODEBOOK, decoded_levels
from h3quant.formats.w4a8.spec import GROUP

CHUNK_GROUPS = 512  # groups tested at a time (stopping at the first chunk off the grid)


def _tables() -> dict[str, torch.Tensor]:
    return {"frozen Lloyd-Max": FROZEN_CODEBOOK.float(),
            "uniform": torch.arange(-8, 8, dtype=torch.float32)}


def _e4m3_positive() -> torch.Tensor:
    """Every positive finite e4m3 value (bit patterns 0x01..0x7E)."""
    return torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _membership(table: torch.Tensor) -> torch.Tensor:
    """[S, 255] bool: code v (+127) is a level of the grid of scale number s."""
    s = _e4m3_positive()
    grid = decoded_levels(table, s).long() + 127
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
        if all(bool(member[:, g[i:i + CHUNK_GROUPS]].all(-1).any(0).all())
               for i in range(0, g.shape[0], CHUNK_GROUPS)):
            return name
    return None


def grid_origin(q: torch.Tensor) -> str | None:
    """What ``codec.grid.grid_origin`` says for W4A8: the table and group of the grid ``q`` lies on."""
    table = grid_table(q)
    return None if table is None else f"{table} levels, groups of {GROUP}"
