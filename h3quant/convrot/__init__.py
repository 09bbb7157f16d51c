"""The ConvRot Hadamard: H_g for powers of 4 and blockwise rotation of the last dim."""

from h3quant.convrot.hadamard import (
    GroupSizeError,
    check_group_size,
    hadamard,
    is_valid_group_size,
    rotate,
    rotate_dense,
    rotate_exact,
)

__all__ = [
    "GroupSizeError",
    "check_group_size",
    "hadamard",
    "is_valid_group_size",
    "rotate",
    "rotate_dense",
    "rotate_exact",
]
