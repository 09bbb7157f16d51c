"""The ConvRot Hadamard: H_g for powers of 4 and blockwise rotation of the last dim."""

from h3quant.convrot.hadamard import (
    check_group_size,
    hadamard,
    is_valid_group_size,
    rotate,
    rotate_dense,
)

__all__ = ["check_group_size", "hadamard", "is_valid_group_size", "rotate", "rotate_dense"]
