"""ConvRot Hadamard matrices (Kronecker powers of the 4x4 H4, not Sylvester's) and rotation.

PLACEHOLDER: dense reference only; the fast butterfly implementation replaces ``rotate``.
"""

from __future__ import annotations

import functools

import torch

_H4 = ((1.0, 1.0, 1.0, -1.0), (1.0, 1.0, -1.0, 1.0), (1.0, -1.0, 1.0, 1.0), (-1.0, 1.0, 1.0, 1.0))


def is_valid_group_size(g: int) -> bool:
    """True for powers of 4 from 4 upwards (4, 16, 64, 256, 1024, ...)."""
    if not isinstance(g, int) or isinstance(g, bool) or g < 4:
        return False
    while g % 4 == 0:
        g //= 4
    return g == 1


def check_group_size(g: int) -> None:
    if not is_valid_group_size(g):
        raise ValueError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, 1024), got {g!r}")


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(g: int) -> torch.Tensor:
    check_group_size(g)
    h4 = torch.tensor(_H4, dtype=torch.float64)
    h = h4
    while h.shape[0] < g:
        h = torch.kron(h, h4)
    return (h / (g ** 0.5)).to(torch.float32)


def hadamard(g: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised ConvRot Hadamard H_g (fp32, symmetric, orthogonal, involutory)."""
    h = _hadamard_cpu(g)
    return h if device is None else h.to(device)


def rotate_dense(x: torch.Tensor, g: int) -> torch.Tensor:
    """Reference: ``x[..., block] @ H_g`` for every block of ``g`` columns, in fp32."""
    check_group_size(g)
    k = x.shape[-1]
    if k % g:
        raise ValueError(f"last dim {k} is not a multiple of the ConvRot group size {g}")
    xf = x.to(torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], k // g, g)
    return (blocks @ hadamard(g, xf.device)).reshape(xf.shape)


def rotate(x: torch.Tensor, g: int) -> torch.Tensor:
    """Blockwise ConvRot rotation of the last dim, fp32 result."""
    return rotate_dense(x, g)
