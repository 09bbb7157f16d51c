"""safetensors dtype names, their sizes, torch equivalents and the library's storage order."""

from __future__ import annotations

import torch

# name -> (itemsize in bytes, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "F8_E5M2": (1, torch.float8_e5m2),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "I16": (2, torch.int16),
    "U16": (2, torch.uint16),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, torch.uint32),
    "F32": (4, torch.float32),
    "F64": (8, torch.float64),
    "I64": (8, torch.int64),
    "U64": (8, torch.uint64),
}

_BY_TORCH = {tdt: name for name, (_, tdt) in DTYPES.items()}

# The safetensors library stores tensors sorted by dtype (this order, widest first, which keeps
# every tensor aligned to its item size), then by name. We write the same order so that files we
# write are byte-identical to what `safetensors.torch.save` makes from the same tensors.
STORAGE_ORDER: tuple[str, ...] = (
    "U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
    "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
)
_RANK = {name: i for i, name in enumerate(STORAGE_ORDER)}

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
QUANTIZED_WEIGHT_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2"})


def itemsize(name: str) -> int:
    return DTYPES[name][0]


def to_torch(name: str) -> torch.dtype:
    return DTYPES[name][1]


def from_torch(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors name") from None


def storage_key(name: str, dtype: str) -> tuple[int, str]:
    """Sort key giving the safetensors library's tensor order."""
    return (_RANK[dtype], name)
