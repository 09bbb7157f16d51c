"""A GGUF header walked in bounded time and memory before the ``gguf`` package reads it.

The package's reader builds Python objects for every metadata element and loops over the
counts a header claims without comparing them with the file's size, so a 128-byte file claiming
2^60 array elements would run it out of memory. ``check_header`` walks the same layout first
(GGUF versions 2 and 3, either byte order): every count and length is checked against the bytes
left in the file and against ``h3quant.limits`` before it is used, numeric arrays are skipped
by arithmetic, and strings are never copied. Only a file that passes is handed to the package.

Layout (the GGUF specification in ggml's docs/gguf.md): magic, u32 version, u64 tensor count,
u64 metadata count; each metadata field a string key, a u32 value type and the value (a string
is a u64 length and its bytes; an array a u32 element type, a u64 count and the elements); each
tensor description a string name, u32 dimension count, u64 dimensions, u32 GGML type and a u64
offset into the data section, which starts at the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import math
import mmap
import os
import struct

from h3quant.errors import ContainerError
from h3quant.limits import MAX_GGUF_METADATA_VALUES, MAX_GGUF_TENSORS

MAX_KEY_BYTES = 65535  # a key or tensor name (the specification's bound on keys)
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 40
MAX_NESTING = 4  # arrays of arrays
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


class _Bad(Exception):
    """A malformed header (turned into one ContainerError naming the file)."""

    def __init__(self, reason: str, tensor: str | None = None):
        super().__init__(reason)
        self.reason, self.tensor = reason, tensor


class _Walker:
    def __init__(self, buf, size: int, order: str):
        self.buf, self.size, self.order, self.pos = buf, size, order, 0
        self.budget = MAX_GGUF_METADATA_VALUES  # metadata fields + array elements, all told

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise _Bad(f"{what} needs {n:,} bytes at offset {self.pos:,}, the file has "
                       f"{self.left():,} left")

    def num(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return int(v)

    def string(self, what: str, limit: int | None = None) -> tuple[int, int]:
        """(offset, length) of a string, its bytes skipped (never copied)."""
        n = self.num("Q", f"{what}'s length")
        if limit is not None and n > limit:
            raise _Bad(f"{what} claims {n:,} bytes (at most {limit:,})")
        self.need(n, what)
        at = self.pos
        self.pos += n
        return at, n

    def text(self, what: str) -> str:
        at, n = self.string(what, MAX_KEY_BYTES)
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} at offset {at:,} is not UTF-8") from None

    def spend(self, n: int, key: str) -> None:
        self.budget -= n
        if self.budget < 0:
            raise _Bad(f"metadata field {key!r} takes the header past "
                       f"{MAX_GGUF_METADATA_VALUES:,} metadata values (fields and array "
                       "elements together, the limit h3quant reads)")

    def value(self, vtype: int, key: str, depth: int = 0) -> int | None:
        """Skip one value of ``vtype``; a u32's value is returned (for the alignment)."""
        if vtype in SCALAR_SIZES:
            size = SCALAR_SIZES[vtype]
            self.need(size, f"the value of {key!r}")
            v = struct.unpack_from(self.order + "I", self.buf, self.pos)[0] \
                if vtype == UINT32 else None
            self.pos += size
            return v
        if vtype == STRING:
            self.string(f"the string value of {key!r}")
            return None
        if vtype != ARRAY:
            raise _Bad(f"metadata field {key!r} has value type {vtype} (GGUF defines 0-12)")
        if depth >= MAX_NESTING:
            raise _Bad(f"metadata field {key!r} nests arrays deeper than {MAX_NESTING}")
        itype = self.num("I", f"the array type of {key!r}")
        count = self.num("Q", f"the array length of {key!r}")
        smallest = SCALAR_SIZES.get(itype, 8 if itype == STRING else 12)
        if itype not in SCALAR_SIZES and itype not in (STRING, ARRAY):
            raise _Bad(f"metadata array {key!r} has element type {itype} (GGUF defines 0-12)")
        if count > self.left() // smallest:
            raise _Bad(f"metadata array {key!r} claims {count:,} elements; the "
                       f"{self.left():,} bytes left in the file hold at most "
                       f"{self.left() // smallest:,}")
        self.spend(count, key)
        if itype in SCALAR_SIZES:
            self.pos += count * smallest
            return None
        for _ in range(count):  # bounded by the budget just spent
            self.value(itype, key, depth + 1)
        return None


def check_header(path: str | os.PathLike) -> int:
    """Walk ``path``'s GGUF header; raises ``ContainerError`` (naming the file, and the tensor
    where one is at fault) unless every count, length, type and tensor data range is sound and
    within ``h3quant.limits``. Returns the offset of the data section."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise ContainerError(f"malformed GGUF header: the file has {size} bytes, a GGUF "
                                     "header at least 24", path=path)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(buf, size)
    except _Bad as e:
        raise ContainerError(f"malformed GGUF header: {e.reason}", path=path,
                             tensor=e.tensor) from None


def _walk(buf, size: int) -> int:
    if bytes(buf[:4]) != b"GGUF":
        raise _Bad("no GGUF magic")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise _Bad(f"GGUF version {version} (the gguf package reads versions 2 and 3)")
    w = _Walker(buf, size, order)
    w.pos = 8
    tensors = w.num("Q", "the tensor count")
    fields = w.num("Q", "the metadata count")
    if fields > MAX_GGUF_METADATA_VALUES:
        raise _Bad(f"{fields:,} metadata fields (h3quant reads at most "
                   f"{MAX_GGUF_METADATA_VALUES:,})")
    if fields > w.left() // 13:  # a key length, a type and a one-byte value at the least
        raise _Bad(f"the header claims {fields:,} metadata fields; the file's {size:,} bytes "
                   f"hold at most {w.left() // 13:,}")
    if tensors > MAX_GGUF_TENSORS:
        raise _Bad(f"{tensors:,} tensors (h3quant reads at most {MAX_GGUF_TENSORS:,})")
    if tensors > w.left() // 24:  # a name length, a dimension count, a type and an offset
        raise _Bad(f"the header claims {tensors:,} tensors; the file's {size:,} bytes hold at "
                   f"most {w.left() // 24:,} descriptions")
    alignment = DEFAULT_ALIGNMENT
    seen: set[str] = set()
    for i in range(fields):
        key = w.text(f"metadata key {i}")
        if key in seen:
            raise _Bad(f"metadata key {key!r} appears twice")
        seen.add(key)
        w.spend(1, key)
        vtype = w.num("I", f"the value type of {key!r}")
        v = w.value(vtype, key)
        if key == "general.alignment":
            if vtype != UINT32 or v is None or v == 0 or v & (v - 1):
                raise _Bad("general.alignment is not a power of two stored as u32")
            alignment = v
    infos = []
    names: set[str] = set()
    for i in range(tensors):
        name = w.text(f"tensor name {i}")
        if name in names:
            raise _Bad("the tensor name appears twice", name)
        names.add(name)
        try:
            ndims = w.num("I", "the dimension count")
            if ndims > MAX_DIMS:
                raise _Bad(f"{ndims} dimensions (at most {MAX_DIMS})")
            dims = [w.num("Q", "a dimension") for _ in range(ndims)]
            n = math.prod(dims)
            if n > MAX_ELEMENTS:
                raise _Bad(f"shape {dims} holds {n:,} elements (at most {MAX_ELEMENTS:,})")
            qtype = w.num("I", "the tensor type")
            offset = w.num("Q", "the data offset")
        except _Bad as e:
            raise _Bad(e.reason, name) from None
        infos.append((name, n, qtype, offset))
    data = w.pos + (-w.pos % alignment)
    _check_data(infos, data, size)
    return data


def _check_data(infos, data: int, size: int) -> None:
    """Every tensor's type known and its bytes inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
    for name, n, qtype, offset in infos:
        if qtype not in known:
            raise _Bad(f"GGML type {qtype} is not one the gguf package knows", name)
        block, nbytes = known[qtype]
        if n % block:
            tname = GGMLQuantizationType(qtype).name
            raise _Bad(f"{n:,} elements are not whole {tname} blocks of {block}", name)
        end = data + offset + n // block * nbytes
        if end > size:
            raise _Bad(f"the tensor's data ends at byte {end:,}, past the file's {size:,}", name)
