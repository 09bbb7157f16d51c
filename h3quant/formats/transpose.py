"""Streamed transposes of 1-byte matrices, the engine of every layout that stores a weight
``[K, N]`` (a format's ``spec.storage.transposed_outputs`` / ``column_sources``).

``RowTransposer`` writes the transpose of a ``[rows, cols]`` 1-byte matrix that arrives in row
order (in any chunk sizes) as byte ranges of the ``[cols, rows]`` output: it buffers at most
``buffer_bytes`` of input rows, transposes that slab and hands each output row's piece to a
``write(offset, bytes)`` callback. Memory is two slabs, whatever the tensor size, and every
relayout (canonical -> transposed, transposed -> canonical, freshly encoded codes ->
transposed) goes through it. ``transpose_stream`` drives it over a stored tensor read in row
slabs. No devices, no files, no format: pure tensor and byte work. Importing this module does
not import torch; the transposer imports it when built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from h3quant.errors import FormatError

if TYPE_CHECKING:
    import torch

TRANSPOSE_BYTES = 64 << 20  # input slab of a chunked transpose


class RowTransposer:
    """Stream the transpose of a ``[rows, cols]`` 1-byte matrix whose rows arrive in order.

    ``add(block)`` takes the next ``block.shape[0]`` rows; whenever ``buffer_bytes`` of rows are
    pending they are transposed and written: for output row ``j`` (input column ``j``) the bytes
    of rows ``[r0, r1)`` go to byte offset ``j * rows + r0`` through ``write(offset, data)``.
    ``finish()`` flushes the rest and checks that every row came. When one slab holds every
    row the whole output is written in a single call.
    """

    def __init__(self, rows: int, cols: int, write: Callable[[int, memoryview], None], *,
                 buffer_bytes: int = TRANSPOSE_BYTES):
        import torch

        if rows < 0 or cols < 0:
            raise FormatError(f"cannot transpose a [{rows}, {cols}] matrix")
        self.rows, self.cols, self._write = rows, cols, write
        self.slab_rows = max(1, min(rows, buffer_bytes // max(cols, 1)))
        self._buf = torch.empty((self.slab_rows, cols), dtype=torch.int8)
        self._out = torch.empty((cols, self.slab_rows), dtype=torch.int8)
        self._fill = 0  # rows pending in _buf
        self._done = 0  # rows already written

    @property
    def rows_seen(self) -> int:
        return self._done + self._fill

    def add(self, block: torch.Tensor) -> None:
        if block.dim() != 2 or block.shape[1] != self.cols or block.element_size() != 1:
            raise FormatError(f"transpose input rows must be 1-byte [*, {self.cols}], got "
                              f"{block.dtype} {list(block.shape)}")
        if self.rows_seen + block.shape[0] > self.rows:
            raise FormatError(f"{self.rows_seen + block.shape[0]} rows given for a "
                              f"[{self.rows}, {self.cols}] transpose")
        block = block.view(self._buf.dtype)
        pos = 0
        while pos < block.shape[0]:
            take = min(self.slab_rows - self._fill, block.shape[0] - pos)
            self._buf[self._fill:self._fill + take].copy_(block[pos:pos + take])
            self._fill += take
            pos += take
            if self._fill == self.slab_rows:
                self._flush()

    def _flush(self) -> None:
        r = self._fill
        if not r:
            return
        r0 = self._done
        out = self._out[:, :r] if r < self.slab_rows else self._out
        out.copy_(self._buf[:r].t())  # the only transpose copy: one slab
        if r == self.rows:  # the whole matrix in one slab: one contiguous write
            # numpy declares ndarray.__buffer__ for Python >= 3.12 only: an ndarray is a buffer
            self._write(0, memoryview(out.contiguous().numpy()).cast("B"))  # type: ignore[arg-type]
        else:
            rows = self.rows
            for j in range(self.cols):
                self._write(j * rows + r0, memoryview(out[j].numpy()).cast("B"))  # type: ignore[arg-type]
        self._done += r
        self._fill = 0

    def finish(self) -> None:
        self._flush()
        if self._done != self.rows:
            raise FormatError(f"transpose got {self._done} of {self.rows} rows")


def transpose_stream(read_rows: Callable[[int, int], torch.Tensor], rows: int, cols: int,
                     write: Callable[[int, memoryview], None], *,
                     buffer_bytes: int = TRANSPOSE_BYTES,
                     release: Callable[[int, int], None] | None = None) -> None:
    """Write the transpose of a stored ``[rows, cols]`` 1-byte tensor read ``read_rows(r0, r1)``
    one slab at a time (``release(r0, r1)`` after each slab, to drop mapped pages)."""
    t = RowTransposer(rows, cols, write, buffer_bytes=buffer_bytes)
    for r0 in range(0, rows, t.slab_rows):
        r1 = min(rows, r0 + t.slab_rows)
        t.add(read_rows(r0, r1))
        if release is not None:
            release(r0, r1)
    t.finish()
