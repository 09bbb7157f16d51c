"""Hostile GGUF headers for the tests and ``bench/hostile.py``: tiny files (at most a few MB)
whose counts and lengths claim far more than they hold, or more than ``h3quant.limits``
allows, written byte by byte here from the GGUF layout (the gguf package's writer refuses to
write most of them)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

U8, U32, STRING, ARRAY = 0, 4, 8, 9


def _s(b: bytes, claim: int | None = None) -> bytes:
    return struct.pack("<Q", len(b) if claim is None else claim) + b


def gguf_bytes(fields: Sequence[bytes] = (), tensors: Sequence[bytes] = (), *, n_fields: int | None = None,
               n_tensors: int | None = None, tail: bytes = b"") -> bytes:
    """A GGUF v3 header of raw ``fields`` and ``tensors`` (their counts overridable), then
    ``tail``."""
    nf = len(fields) if n_fields is None else n_fields
    nt = len(tensors) if n_tensors is None else n_tensors
    return b"GGUF" + struct.pack("<IQQ", 3, nt, nf) + b"".join(fields) + b"".join(tensors) + tail


def field(key: str, vtype: int, value: bytes) -> bytes:
    return _s(key.encode()) + struct.pack("<I", vtype) + value


def array(itype: int, count: int, body: bytes) -> bytes:
    return struct.pack("<IQ", itype, count) + body


def tensor(name: str, dims: list[int], qtype: int = 0, offset: int = 0) -> bytes:
    """A tensor description (``qtype`` 0 = F32)."""
    return (_s(name.encode()) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", qtype, offset))


ARCH = field("general.architecture", STRING, _s(b"minimax_h3"))


def hostile_ggufs() -> dict[str, bytes]:
    """name -> file bytes; each must be refused (a clear error naming the file), fast."""
    one = tensor("blocks.0.norm.weight", [32])
    return {
        # a 128-byte file whose array claims 2^60 elements
        "array 2^60": gguf_bytes([ARCH, field("x.bomb", ARRAY, array(U32, 1 << 60, b"\0" * 64))]),
        # 5 MB, five million real u8 elements (each one a Python object in the package)
        "array 5e6 u8": gguf_bytes([ARCH, field("x.big", ARRAY, array(U8, 5_000_000,
                                                                     bytes(5_000_000)))]),
        # 9 MB, a million short strings
        "1e6 strings": gguf_bytes([ARCH, field("x.words", ARRAY, array(STRING, 1_000_000,
                                                                      _s(b"a") * 1_000_000))]),
        # a string value claiming 2^62 bytes
        "string 2^62": gguf_bytes([ARCH, field("x.s", STRING, _s(b"abc", 1 << 62))], [one]),
        # a key claiming 2^40 bytes
        "key 2^40": gguf_bytes([_s(b"k", 1 << 40) + struct.pack("<I", U8) + b"\0"]),
        # 2^62 metadata fields in a 100-byte file
        "fields 2^62": gguf_bytes([ARCH], n_fields=1 << 62),
        # 2^40 tensor descriptions
        "tensors 2^40": gguf_bytes([ARCH], [one], n_tensors=1 << 40),
        # arrays nested to depth 64, one element each
        "nested 64": gguf_bytes([ARCH, field("x.deep", ARRAY, array(ARRAY, 1, b"") * 64
                                             + array(U8, 1, b"\0"))]),
        # 200,000 small metadata fields (each within the file)
        "2e5 fields": gguf_bytes([field(f"k{i}", U8, b"\0") for i in range(200_000)]),
        # a tensor whose data lies past the end of the file
        "data past the end": gguf_bytes([ARCH], [tensor("blocks.0.norm.weight", [1 << 30])]),
        # a shape of 2^64 - 1 elements in each of two dimensions
        "shape 2^128": gguf_bytes([ARCH], [tensor("blocks.0.norm.weight",
                                                  [(1 << 64) - 1, (1 << 64) - 1])]),
        # an unknown GGML type
        "type 999": gguf_bytes([ARCH], [tensor("blocks.0.norm.weight", [32], 999)]),
    }


def write_hostile(d: Path) -> dict[str, Path]:
    """Every ``hostile_ggufs`` file under directory ``d`` (name -> path)."""
    out = {}
    for i, (name, raw) in enumerate(hostile_ggufs().items()):
        p = Path(d) / f"hostile-{i:02d}.gguf"
        p.write_bytes(raw)
        out[name] = p
    return out
