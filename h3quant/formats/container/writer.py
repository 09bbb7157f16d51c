"""Streaming, atomic safetensors writer.

The whole header (names, dtypes, shapes, offsets) is computed before any data is written, so data
can be streamed one tensor (or one chunk) at a time. Tensors are laid out in the safetensors
library's order (dtype width, then name) and the header is serialised the way the library does
(compact JSON, metadata first with sorted keys, space padding to a multiple of 8), so the bytes
equal ``safetensors.torch.save`` for the same tensors. Output goes to a temporary file beside the
target and is renamed into place only when every byte has been written.

Importing this module does not import torch (planning a layout is header work: ``convert`` opens
its writers and starts copying before torch is loaded); the tensor helpers import it on use.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant.errors import ContainerError
from h3quant.formats.container.atomic import default_mode, open_temp, publish  # noqa: F401 (re-export)
from h3quant.formats.container.dtypes import from_torch, itemsize, storage_key

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Layout:
    """The full output header and where each tensor's bytes go."""

    header: bytes  # 8-byte length + padded JSON
    order: tuple[Entry, ...]
    offsets: dict[str, tuple[int, int]]
    entries: dict[str, Entry]

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.order)

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.data_bytes


def plan_layout(entries: list[Entry], metadata: dict[str, str] | None = None, *,
                keep_order: bool = False) -> Layout:
    """The header and offsets of ``entries``: in the safetensors library's order, or with
    ``keep_order`` in the order given (a valid file, not byte-equal to the library's, which a
    writer producing one group of tensors at a time can stream without holding the others)."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ContainerError(f"duplicate tensor names: {', '.join(dup[:5])}")
    order = tuple(entries) if keep_order else tuple(
        sorted(entries, key=lambda e: storage_key(e.name, e.dtype)))
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for e in order:
        offsets[e.name] = (pos, pos + e.nbytes)
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return Layout(struct.pack("<Q", len(text)) + text, order, offsets, {e.name: e for e in order})


def entry_for(name: str, tensor: torch.Tensor) -> Entry:
    return Entry(name, from_torch(tensor.dtype), tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # numpy declares ndarray.__buffer__ for Python >= 3.12 only: an ndarray is a buffer on every version
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class StreamingWriter:
    """Write ``layout``'s tensors in order to ``path`` through a temporary file.

    Use as a context manager: on a clean exit after every tensor was written the temporary file is
    fsynced and renamed to ``path``; on any exception it is removed and ``path`` is untouched.
    """

    def __init__(self, path: str | os.PathLike, layout: Layout):
        self.path = Path(path)
        self.layout = layout
        self._index = 0
        self._written = 0  # bytes of the current tensor
        self._fh: io.FileIO | None = None
        self._tmp: Path | None = None

    def __enter__(self) -> "StreamingWriter":
        fd, self._tmp = open_temp(self.path)
        self._fh = fh = os.fdopen(fd, "wb", buffering=0)
        fh.write(self.layout.header)
        self._skip_empty()
        return self

    def _skip_empty(self) -> None:
        while self.current is not None and self.current.nbytes == 0:
            self._index += 1

    @property
    def current(self) -> Entry | None:
        order = self.layout.order
        return order[self._index] if self._index < len(order) else None

    def write(self, name: str, data) -> None:
        """Append bytes (all or part) of tensor ``name``, which must be the next one in order."""
        entry = self.current
        if entry is None or entry.name != name:
            expected = entry.name if entry else "nothing"
            raise ContainerError(f"writer expected {expected}, got {name}", path=self.path, tensor=name)
        mv = memoryview(data).cast("B")
        if self._written + mv.nbytes > entry.nbytes:
            raise ContainerError(f"{self._written + mv.nbytes} bytes written, header says {entry.nbytes}",
                                 path=self.path, tensor=name)
        assert self._fh is not None, "write() outside the with block"
        self._fh.write(mv)
        self._written += mv.nbytes
        if self._written == entry.nbytes:
            self._index += 1
            self._written = 0
            self._skip_empty()

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        planned = self.layout.entries.get(name)
        got = (from_torch(tensor.dtype), tuple(tensor.shape))
        if planned is None or got != (planned.dtype, planned.shape):
            want = f"{planned.dtype} {list(planned.shape)}" if planned else "no such tensor"
            raise ContainerError(f"tensor is {got[0]} {list(got[1])}, header planned {want}",
                                 path=self.path, tensor=name)
        if planned.nbytes:
            self.write(name, tensor_bytes(tensor))

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._fh is not None and self._tmp is not None  # set by __enter__
        try:
            if exc_type is None:
                if self.current is not None:
                    raise ContainerError(f"output incomplete: {self.current.name} and later tensors "
                                         "were never written", path=self.path)
                os.fsync(self._fh.fileno())
            self._fh.close()
            if exc_type is None:
                publish(self._tmp, self.path)
                self._tmp = None
        finally:
            if self._tmp is not None:
                self._tmp.unlink(missing_ok=True)


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None) -> Layout:
    """Write a small dict of tensors atomically (synthetic checkpoints, tests)."""
    layout = plan_layout([entry_for(n, t) for n, t in tensors.items()], metadata)
    with StreamingWriter(path, layout) as w:
        for e in layout.order:
            w.write_tensor(e.name, tensors[e.name])
    return layout
