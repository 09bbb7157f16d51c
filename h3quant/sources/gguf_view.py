"""A GGUF file seen as a float safetensors checkpoint with ComfyUI's names, read in place.

``GgufView`` has the reading interface of a ``formats.container.checkpoint.Checkpoint`` that the
forward (``H3Model``) and ``convert`` use: ``path``, ``files`` (one virtual file), ``tensors``
(ComfyUI name -> ``TensorInfo``), ``metadata``, ``info``, ``file_of``, ``read``,
``read_bytes``, ``check_unchanged``, ``close``; ``input_files`` names the GGUF file, which the
output rules protect. Nothing is written anywhere: a quantized tensor is seen as F32, an F16
tensor as F16, any other float as F32, and each read dequantizes only the GGUF blocks holding
the bytes asked for (``GgufFile.read_values``, the gguf package's own dequantize), so a
convert reading a weight in row chunks holds one chunk of float values at a time, and the
file's mapped pages are dropped once read (``release_pages``).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

from h3quant.errors import ClosedError, ContainerError
from h3quant.formats.container.reader import TensorInfo, check_identity, identity, open_input
from h3quant.formats.container.virtual import VirtualFile
from h3quant.formats.gguf.reader import GgufFile, GgufTensor

METADATA_KEY = "h3quant.gguf_source"
ALIGN = 64


def view_dtype(qtype: str) -> str:
    """The safetensors dtype a GGUF tensor type is seen as (values kept exactly)."""
    return "F16" if qtype == "F16" else "F32"


class _GgufViewFile(VirtualFile):
    """The one file of a ``GgufView``: the reading interface of a ``SafetensorsFile``
    (``read_bytes``, ``release_pages``, ``prefetch``, ``forward``, ``check_unchanged``)."""

    use_mmap = True  # reads are independent slices of a read-only mapping: no lock needed

    def forward(self, info: TensorInfo):
        """No tensor is stored as the view shows it: every read is computed (never copied
        inside the kernel)."""
        return None

    def read_bytes(self, info: TensorInfo, start: int = 0, length: int | None = None):
        """Bytes ``[start, start + length)`` of the tensor as the view shows it."""
        import numpy as np

        length = info.nbytes - start if length is None else length
        if start < 0 or length < 0 or start + length > info.nbytes:
            raise ContainerError(f"bytes [{start}, {start + length}) outside the tensor's "
                                 f"{info.nbytes}", path=self.view.path, tensor=info.name)
        if length == 0:
            return bytearray()
        size = 2 if info.dtype == "F16" else 4
        first, stop = start // size, -(-(start + length) // size)
        values = self.view.gguf.read_values(info.name, first, stop)
        if info.dtype == "F16":
            values = values.astype(np.float16)  # F16 stored: widened and narrowed exactly
        data = np.ascontiguousarray(values).reshape(-1).view(np.uint8).data
        skip = start - first * size
        return data[skip:skip + length]

    def _advise(self, advice_name: str, info: TensorInfo, start: int, length: int | None):
        advice = getattr(mmap, advice_name, None)
        mm = self.view.mapping()
        if advice is None or mm is None or info.nbytes == 0:
            return
        length = info.nbytes - start if length is None else length
        size = 2 if info.dtype == "F16" else 4
        first, stop = start // size, -(-(start + length) // size)
        if stop <= first:
            return
        begin, n = self.view.gguf.byte_range(info.name, first, stop)
        lo = begin - begin % mmap.PAGESIZE
        hi = min(begin + n, len(mm))
        if hi > lo:
            try:
                mm.madvise(advice, lo, hi - lo)
            except (OSError, ValueError):
                pass  # advice only

    def release_pages(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        """Let the kernel drop the file's mapped pages behind a byte range (a read-only mapping
        of the file: dropped pages are read again if touched)."""
        self._advise("MADV_DONTNEED", info, start, length)

    def prefetch(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        self._advise("MADV_WILLNEED", info, start, length)

    def iter_bytes(self, info: TensorInfo, chunk: int = 64 << 20):
        for start in range(0, info.nbytes, chunk):
            yield self.read_bytes(info, start, min(chunk, info.nbytes - start))

    def check_unchanged(self, **_) -> None:
        self.view.check_unchanged()

    def close(self) -> None:
        pass


class GgufView:
    """A GGUF file (``GgufFile``) with the reading interface of a float ``Checkpoint``."""

    is_sharded = False
    index_path = None

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.findings: list = []
        self.index_metadata: dict = {}
        self.input_files = [self.path]
        self._closed = False
        # Opened before the gguf package maps the path: a file swapped in between is then seen
        # by every check_unchanged (the path no longer names this descriptor's file).
        self._fh = open_input(self.path)
        try:
            self._identity = identity(os.fstat(self._fh.fileno()))
            self.gguf = GgufFile(path)
        except BaseException:
            self._fh.close()
            raise
        try:
            self._file = _GgufViewFile(self, self.path)
            self.files = [self._file]
            self.tensors = self._layout(self.gguf.tensors)
            # the tensors read by dequantizing GGUF blocks (convert --to bf16 writes them BF16)
            self.dequantized = frozenset(n for n, t in self.gguf.tensors.items() if t.quantized)
            types: dict[str, int] = {}
            for t in self.gguf.tensors.values():
                types[t.qtype] = types.get(t.qtype, 0) + 1
            self._metadata = {METADATA_KEY: json.dumps(
                {"file": self.path.name, "architecture": self.gguf.architecture,
                 "types": types}, sort_keys=True)}
        except BaseException:
            self.close()
            raise

    def _layout(self, tensors: dict[str, GgufTensor]) -> dict[str, TensorInfo]:
        """Every tensor at a virtual offset, in the order the GGUF file stores them."""
        from h3quant.formats.container.dtypes import itemsize

        infos: dict[str, TensorInfo] = {}
        offset = 0
        for t in sorted(tensors.values(), key=lambda t: t.index):
            dtype = view_dtype(t.qtype)
            nbytes = t.numel * itemsize(dtype)
            infos[t.name] = TensorInfo(t.name, dtype, t.shape, offset, offset + nbytes,
                                       self._file.path)
            offset += -(-nbytes // ALIGN) * ALIGN
        return dict(sorted(infos.items()))

    def mapping(self):
        """The file's ``mmap`` object under the gguf package's reader (for page advice), or
        None when it cannot be reached."""
        r = self.gguf._reader
        data = getattr(r, "data", None) if r is not None else None
        mm = getattr(data, "_mmap", None)
        return mm if isinstance(mm, mmap.mmap) else None

    # -- Checkpoint's reading interface ---------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    @property
    def total_bytes(self) -> int:
        return self._identity[2]

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ContainerError("no such tensor in the GGUF file", path=self.path,
                                 tensor=name) from None

    def file_of(self, name: str) -> _GgufViewFile:
        if self._closed:
            raise ClosedError(f"this GGUF file was closed; open it again to read '{name}'",
                              path=self.path)
        self.info(name)
        return self._file

    def read(self, name: str):
        import torch

        info = self.info(name)
        if self._closed:
            raise ClosedError(f"this GGUF file was closed; open it again to read '{name}'",
                              path=self.path)
        values = torch.from_numpy(self.gguf.read(name).copy())
        return values.to(torch.float16) if info.dtype == "F16" else values

    def read_bytes(self, name: str):
        return self.file_of(name).read_bytes(self.info(name))

    def iter_bytes(self, name: str, chunk: int | None = None):
        f, info = self.file_of(name), self.info(name)
        return f.iter_bytes(info) if chunk is None else f.iter_bytes(info, chunk)

    def check_unchanged(self) -> None:
        """``ContainerError`` (C109) if the GGUF file was modified, truncated or replaced since
        it was opened."""
        check_identity(self.path, self._fh.fileno(), self._identity)

    def close(self) -> None:
        self._closed = True
        self.gguf.close()
        self._fh.close()

    def __enter__(self) -> "GgufView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
