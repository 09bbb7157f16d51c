"""The ConvRot Hadamard: H_g for powers of 4 and blockwise rotation of the last dim.

The group-size checks come from ``groups`` (no torch); the rotation functions are imported from
``rotation`` (torch) on first use, so header-only commands never import torch.
"""

from h3quant.convrot.groups import GroupSizeError, check_group_size, is_valid_group_size

_LAZY = ("hadamard", "rotate", "rotate_dense", "rotate_exact", "rotate_group_major")

__all__ = ["GroupSizeError", "check_group_size", "is_valid_group_size", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module("h3quant.convrot.rotation"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'h3quant.convrot' has no attribute {name!r}")
