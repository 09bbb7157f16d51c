"""ConvRot group sizes (powers of 4): checks that need no torch, for header-only commands."""

from __future__ import annotations

from h3quant.errors import FormatError


class GroupSizeError(FormatError, ValueError):
    """Invalid ConvRot group size, or a last dim that is not a multiple of it."""


def is_valid_group_size(g: int) -> bool:
    """True for powers of 4 from 4 upwards (4, 16, 64, 256, 1024, ...)."""
    if not isinstance(g, int) or isinstance(g, bool) or g < 4:
        return False
    while g % 4 == 0:
        g //= 4
    return g == 1


def check_group_size(g: int) -> None:
    """Raise ``GroupSizeError`` (a ``FormatError`` and a ``ValueError``) unless ``g`` is a power of 4."""
    if not is_valid_group_size(g):
        raise GroupSizeError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, 1024), got {g!r}")
