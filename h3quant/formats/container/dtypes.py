"""safetensors dtype names, their sizes, torch equivalents and the library's storage order.

torch is imported only when a torch dtype is asked for, so header-only commands start fast.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> (itemsize in bytes, name of the torch dtype)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
}

# The safetensors library stores tensors sorted by dtype (this order, widest first, which keeps
# every tensor aligned to its item size), then by name. We write the same order so that files we
# write are byte-identical to what `safetensors.torch.save` makes from the same tensors.
STORAGE_ORDER: tuple[str, ...] = (
    "U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
    "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
)
_RANK = {name: i for i, name in enumerate(STORAGE_ORDER)}

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
QUANTIZED_WEIGHT_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2"})


_FLOAT_STRUCT = {"F64": "<d", "F32": "<f", "F16": "<e"}  # little-endian, as safetensors stores


def float_value(raw: bytes, dtype: str) -> float | None:
    """The first value of the little-endian ``dtype`` bytes ``raw`` (BF16, F16, F32 or F64) as a
    Python float, exactly, without torch; None for any other dtype."""
    if dtype == "BF16":  # the upper half of an F32
        return float(struct.unpack("<f", b"\0\0" + raw[:2])[0])
    fmt = _FLOAT_STRUCT.get(dtype)
    if fmt is None:
        return None
    return float(struct.unpack(fmt, raw[:struct.calcsize(fmt)])[0])


def itemsize(name: str) -> int:
    return DTYPES[name][0]


def to_torch(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; UnsupportedError when this torch lacks it
    (``float8_e8m0fnu`` arrived in torch 2.7)."""
    import torch

    dtype = getattr(torch, DTYPES[name][1], None)
    if dtype is None:
        from h3quant.errors import UnsupportedError

        raise UnsupportedError(f"this torch ({torch.__version__}) has no {DTYPES[name][1]} dtype to "
                               f"read {name} tensor data; upgrade torch")
    return dtype


def from_torch(dtype: torch.dtype) -> str:
    attr = str(dtype).removeprefix("torch.")
    for name, (_, tname) in DTYPES.items():
        if tname == attr:
            return name
    raise ValueError(f"torch dtype {dtype} has no safetensors name")


def storage_key(name: str, dtype: str) -> tuple[int, str]:
    """Sort key giving the safetensors library's tensor order."""
    return (_RANK[dtype], name)


# float dtype -> (unsigned integer view, exponent mask): a value is NaN or infinite exactly when
# every exponent bit is set (IEEE 754 binary16/32/64 and bfloat16)
_EXPONENT = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000),
             "F64": ("<u8", 0x7FF0000000000000)}


def nonfinite(data, dtype: str) -> tuple[int, int | None]:
    """(count, first flat index or None) of the NaN and infinite values in raw little-endian
    ``data`` of float ``dtype`` (bit tests in numpy: no torch, no float conversion)."""
    import numpy as np

    view, mask = _EXPONENT[dtype]
    a = np.frombuffer(data, dtype=view)
    bad = (a & np.array(mask, dtype=view)) == mask
    n = int(np.count_nonzero(bad))
    return n, (int(np.argmax(bad)) if n else None)
