"""cuBLAS's blocked layout of block scales, shared by the formats that store them so (nvfp4's
e4m3 scales per 16 values, mxfp8's e8m0 scales per 32): a ``[R, C]`` grid is zero-padded to
``[roundup(R, 128), roundup(C, 4)]`` and cut into 128 x 4 tiles stored one after another, each
as 32 rows of 16 bytes: grid row ``32 i + j`` (``i`` < 4), column ``c`` of a tile is stored at
tile row ``j``, column ``4 i + c``. The stored rows ``[128 t, 128 t + 128)`` hold exactly the
scales of grid rows ``[128 t, 128 t + 128)``. Facts: NVIDIA's cuBLAS documentation ("1D block
scaling factors layout") and comfy-kitchen's ``float_utils.to_blocked``. Torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TILE_ROWS, TILE_COLS = 128, 4


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def swizzle(grid: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` block scales -> the blocked ``[roundup(R, 128), roundup(C, 4)]`` tensor."""
    import torch

    r, c = grid.shape
    rp, cp = roundup(r, TILE_ROWS), roundup(c, TILE_COLS)
    if (rp, cp) != (r, c):
        padded = torch.zeros((rp, cp), dtype=grid.dtype, device=grid.device)
        padded[:r, :c] = grid
        grid = padded
    t = grid.reshape(rp // TILE_ROWS, 4, 32, cp // TILE_COLS, TILE_COLS)  # row = 32 i + j
    return t.permute(0, 3, 2, 1, 4).reshape(rp, cp).contiguous()  # tile, j, (i, c)


def unswizzle(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle``: the ``[rows, cols]`` grid of a blocked ``[Rp, Cp]`` tensor."""
    rp, cp = blocked.shape
    t = blocked.reshape(rp // TILE_ROWS, cp // TILE_COLS, 32, 4, TILE_COLS)  # tile, j, i, c
    return t.permute(0, 3, 2, 1, 4).reshape(rp, cp)[:rows, :cols]
