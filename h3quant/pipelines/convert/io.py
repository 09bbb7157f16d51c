"""I/O for ``convert``: positional atomic writer and bounded-memory reads.

Why not ``StreamingWriter``: it requires layout order, and the safetensors layout puts every F32
tensor (the per-row scales) before every I8 tensor (the codes). Writing in that order would mean
holding all codes of the model or quantizing every weight twice. ``OffsetWriter`` uses the same
``Layout`` (so the bytes are identical to the library's) but lets each tensor be written, in
pieces, at its own offset as soon as it is computed: one layer in flight, each weight quantized
once.

``copy_tensor`` writes a byte-for-byte tensor, inside the kernel where it can. Nothing here
imports torch at import time: ``convert`` opens its writers and starts the copies first, and
loads torch while they run (see ``convert.stream``); the tensor methods import it on use.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant.errors import ContainerError, FindingError
from h3quant.formats.container.atomic import open_temp, publish
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.dtypes import FLOAT_DTYPES, itemsize, nonfinite, to_torch
from h3quant.formats.container.platform import datasync, pwrite
from h3quant.formats.container.writer import Layout, tensor_bytes

if TYPE_CHECKING:
    import torch

FLUSH_BYTES = 256 << 20  # start writeback after this many new bytes (overlaps the final fsync)
COPY_CHUNK = 16 << 20  # bytes per copy call (kernel-side or through memory)


class OffsetWriter:
    """Write ``layout``'s tensors, in any order and in pieces, to ``path`` through a temp file.

    Context manager: on a clean exit, every byte of every tensor must have been written; the
    temp file is fsynced and renamed to ``path``. On any exception it is removed and ``path`` is
    untouched. A background thread ``fdatasync``s every ``FLUSH_BYTES`` written, so the disk
    works while the conversion computes instead of all at the end.
    """

    def __init__(self, path: str | os.PathLike, layout: Layout):
        self.path = Path(path)
        self.layout = layout
        self._base = len(layout.header)
        self._sizes = {e.name: e.nbytes for e in layout.order}
        self._done = dict.fromkeys(self._sizes, 0)
        self._fd: int | None = None
        self._tmp: Path | None = None
        # Byte accounting and the fd's lifetime: writes may come from several threads, and after
        # an error a straggling thread must never write through a closed (maybe reused) fd.
        self._lock = threading.Condition()
        self._active = 0  # pwrite / fdatasync calls in progress
        self._closed = False
        self._unflushed = 0
        self._flush_wanted = threading.Event()
        self._closing = False
        self._flusher: threading.Thread | None = None

    def __enter__(self) -> "OffsetWriter":
        self._fd, self._tmp = open_temp(self.path)
        fd = self._fd
        try:
            os.ftruncate(fd, self.layout.file_bytes)
            pwrite(fd, self.layout.header, 0)
        except BaseException:
            self._abort()
            raise
        self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                         name="h3quant-flush")
        self._flusher.start()
        return self

    def _flush_loop(self) -> None:
        while True:
            self._flush_wanted.wait()
            self._flush_wanted.clear()
            if self._closing:
                return
            try:
                fd = self._enter_fd()
            except ContainerError:
                return
            try:
                datasync(fd)
            except OSError:
                return  # the final fsync reports real errors
            finally:
                self._leave_fd()

    def _enter_fd(self) -> int:
        with self._lock:
            if self._closed or self._fd is None:
                raise ContainerError("writer is closed", path=self.path)
            self._active += 1
            return self._fd

    def _leave_fd(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._lock.notify_all()

    def write(self, name: str, start: int, data) -> None:
        """Write ``data`` (bytes-like) at byte ``start`` of tensor ``name``."""
        mv = memoryview(data).cast("B")
        size = self._sizes.get(name)
        if size is None:
            raise ContainerError("tensor is not in the planned layout", path=self.path, tensor=name)
        if start < 0 or start + mv.nbytes > size:
            raise ContainerError(f"bytes [{start}, {start + mv.nbytes}) fall outside the planned "
                                 f"{size}", path=self.path, tensor=name)
        pos = self._base + self.layout.offsets[name][0] + start
        fd = self._enter_fd()
        try:
            while mv.nbytes:
                n = pwrite(fd, mv, pos)
                mv, pos = mv[n:], pos + n
                self._account(name, n)
        finally:
            self._leave_fd()

    def copy_range(self, name: str, start: int, src_fd: int, src_pos: int, length: int) -> int:
        """Copy up to ``length`` bytes at ``src_pos`` of ``src_fd`` to byte ``start`` of tensor
        ``name`` inside the kernel (one ``os.copy_file_range``: no user-space copy, no page
        faults on a mapping). Returns the bytes copied (> 0); raises OSError where the kernel
        or filesystem cannot, having copied nothing (the caller then copies through memory)."""
        size = self._sizes.get(name)
        if size is None:
            raise ContainerError("tensor is not in the planned layout", path=self.path, tensor=name)
        if start < 0 or length <= 0 or start + length > size:
            raise ContainerError(f"bytes [{start}, {start + length}) fall outside the planned "
                                 f"{size}", path=self.path, tensor=name)
        pos = self._base + self.layout.offsets[name][0] + start
        fd = self._enter_fd()
        try:
            n = os.copy_file_range(src_fd, fd, length, src_pos, pos)
            if n <= 0:  # the source ended early: the file changed under us
                raise ContainerError(f"source ended at byte {src_pos} while copying",
                                     path=self.path, tensor=name)
            self._account(name, n)
            return n
        finally:
            self._leave_fd()

    def _account(self, name: str, n: int) -> None:
        with self._lock:
            self._done[name] += n
            self._unflushed += n
            if self._unflushed >= FLUSH_BYTES:
                self._unflushed = 0
                self._flush_wanted.set()

    def write_tensor(self, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        if tensor.numel():
            self.write(name, start, tensor_bytes(tensor))

    def missing(self) -> list[str]:
        return [n for n, size in self._sizes.items() if self._done[n] != size]

    def _stop_flusher(self) -> None:
        if self._flusher is not None:
            self._closing = True
            self._flush_wanted.set()
            self._flusher.join()
            self._flusher = None

    def _close_fd(self) -> None:
        """Refuse new writes, wait for the ones in flight, close the fd."""
        with self._lock:
            self._closed = True
            while self._active:
                self._lock.wait()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _abort(self) -> None:
        self._stop_flusher()
        self._close_fd()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        self._stop_flusher()
        try:
            with self._lock:
                self._closed = True
                while self._active:
                    self._lock.wait()
            missing = self.missing()
            if missing:
                raise ContainerError(f"output incomplete: {len(missing)} tensor(s) not fully "
                                     f"written, first {missing[0]}", path=self.path)
            fd, tmp = self._fd, self._tmp
            assert fd is not None and tmp is not None  # set by __enter__
            os.fsync(fd)
            os.close(fd)
            self._fd = None
            publish(tmp, self.path)
            self._tmp = None
        finally:
            self._abort()


class Reader:
    """Row-range reads of a checkpoint's tensors; in mmap mode, pages are dropped after use.

    Dropping the pages (``MADV_DONTNEED`` on the private mapping windows, never written) keeps the resident
    set flat in the size of the checkpoint: without it every page of a memory-mapped input stays
    mapped, and counted, until the file is closed.
    """

    def __init__(self, ckpt):
        self.ckpt = ckpt
        # buffered reads seek a shared file handle: serialise them across worker threads
        self._lock = threading.Lock()

    def _read(self, sf, info: TensorInfo, start: int, length: int):
        if sf.use_mmap:
            return sf.read_bytes(info, start, length)
        with self._lock:
            return sf.read_bytes(info, start, length)

    def rows(self, info: TensorInfo, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of a tensor (dim 0), as a tensor (may view the mapping)."""
        import torch

        row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        sf = self.ckpt.file_of(info.name)
        dtype = to_torch(info.dtype)
        n = r1 - r0
        if n <= 0 or row == 0:
            return torch.empty((max(n, 0), *info.shape[1:]), dtype=dtype)
        data = self._read(sf, info, r0 * row, n * row)
        if isinstance(data, memoryview) and (info.begin + r0 * row) % itemsize(info.dtype):
            data = bytearray(data)  # keep element access aligned
        typed = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        return typed.reshape(n, *info.shape[1:])

    def whole(self, info: TensorInfo) -> torch.Tensor:
        if not info.shape:
            return self.ckpt.read(info.name)
        return self.rows(info, 0, info.shape[0])

    def source_range(self, info: TensorInfo) -> tuple[int, int] | None:
        """(file descriptor, absolute byte offset) of a tensor's data, for kernel-side copies;
        None for a tensor a ``SourceView`` computes (it has no bytes on disk)."""
        sf = self.ckpt.file_of(info.name)
        forward = getattr(sf, "forward", None)
        if forward is not None:
            real = forward(info)
            if real is None:
                return None
            sf, info = real
        return sf.fileno(), info.begin

    def computed_bytes(self, info: TensorInfo):
        """The whole bytes of a tensor a ``SourceView`` computes (None for a stored one)."""
        uncached = getattr(self.ckpt.file_of(info.name), "uncached", None)
        return None if uncached is None else uncached(info)

    def chunks(self, info: TensorInfo, chunk: int, first: int = 0):
        sf = self.ckpt.file_of(info.name)
        for start in range(first, info.nbytes, chunk):
            length = min(chunk, info.nbytes - start)
            yield start, self._read(sf, info, start, length)
            self.release(info, start, length)

    def release(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        """Drop the mapped pages of a byte range of ``info`` (no-op without mmap)."""
        self.ckpt.file_of(info.name).release_pages(info, start, length)

    def release_rows(self, info: TensorInfo, r0: int, r1: int) -> None:
        row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        if row:
            self.release(info, r0 * row, (r1 - r0) * row)

    def prefetch_rows(self, info: TensorInfo, r0: int, r1: int) -> None:
        """Ask the kernel to start reading rows ``[r0, r1)`` (mmap only)."""
        row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        if row:
            self.ckpt.file_of(info.name).prefetch(info, r0 * row, (r1 - r0) * row)


class Sinks:
    """Routes each output tensor name to the writer of its shard; can also write behind.

    ``write_behind`` hands whole tensors to a writer thread and returns, so a layer's outputs
    are written while the next layer computes (with the disk busy with the copies and writeback,
    writing a W4A8 block's 0.2 GB of outputs took 1.6 s of the main thread here, with every
    worker idle). At most one batch is in flight: the next call, and ``wait_behind``, wait for
    it first and raise its error; so memory holds at most one finished layer's outputs.
    """

    def __init__(self, by_name: dict[str, OffsetWriter]):
        self._by_name = by_name
        self._behind: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def write_behind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (name -> whole tensor) on the writer thread, after the previous
        batch is done (its error, if any, is raised here instead)."""
        self.wait_behind()
        if self._behind is None:
            self._behind = ThreadPoolExecutor(1, thread_name_prefix="h3quant-write")
        self._pending = self._behind.submit(self._write_all, dict(tensors))

    def _write_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.write_tensor(name, tensor)

    def wait_behind(self) -> None:
        """Wait for the batch in flight; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Let the batch in flight finish (its error is dropped: the run is over; a batch cut
        short by a closed writer leaves an incomplete output, which the writer refuses)."""
        if self._behind is not None:
            self._behind.shutdown(wait=True)
            self._behind = None

    def write(self, name: str, start: int, data) -> None:
        self._by_name[name].write(name, start, data)

    def write_tensor(self, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        self._by_name[name].write_tensor(name, tensor, start)

    def copy_range(self, name: str, start: int, src_fd: int, src_pos: int, length: int) -> int:
        return self._by_name[name].copy_range(name, start, src_fd, src_pos, length)


# errors meaning "the kernel cannot copy between these files": fall back to read + write
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF,
                   errno.ETXTBSY, errno.EPERM}
_kernel_copy = [hasattr(os, "copy_file_range")]


def copy_tensor(item, reader: Reader, sink, progress) -> None:
    """Copy one tensor's bytes unchanged: inside the kernel where it can (``copy_file_range``:
    no user-space copy, no mapped pages), else in ``COPY_CHUNK`` pieces through memory."""
    info, done = item.src, 0
    where = reader.source_range(info) if _kernel_copy[0] and info.nbytes else None
    if where is not None:
        fd, pos = where
        try:
            while done < info.nbytes:
                n = sink.copy_range(item.out, done, fd, pos + done,
                                    min(COPY_CHUNK, info.nbytes - done))
                done += n
                progress(n)
            return
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            _kernel_copy[0] = False  # this run goes on through memory (from byte ``done``)
    whole = reader.computed_bytes(info)
    if whole is not None:  # computed by a SourceView: once, whole, not through its cache
        for start in range(done, info.nbytes, COPY_CHUNK):
            piece = whole[start:start + COPY_CHUNK]
            sink.write(item.out, start, piece)
            progress(len(piece))
        return
    for start, data in reader.chunks(info, COPY_CHUNK, first=done):
        sink.write(item.out, start, data)
        progress(len(data))


def check_finite(info: TensorInfo, reader: Reader) -> None:
    """Refuse a float tensor copied unchanged that holds NaN or infinity (D106, the rule
    ``validate --deep`` applies to every float tensor): copying it would write a file that
    ``validate --deep`` fails. Read in ``COPY_CHUNK`` pieces, bits tested without torch."""
    if info.dtype not in FLOAT_DTYPES or not info.nbytes:
        return
    whole = reader.computed_bytes(info)
    parts = [(0, whole)] if whole is not None else reader.chunks(info, COPY_CHUNK)
    size = itemsize(info.dtype)
    bad, first = 0, None
    for start, data in parts:
        n, i = nonfinite(data, info.dtype)
        if i is not None and first is None:
            first = start // size + i
        bad += n
    if bad:
        raise FindingError(f"source tensor (copied unchanged): {bad} of "
                           f"{info.nbytes // size} values are NaN or infinite (first at flat index "
                           f"{first}); expected finite values; nothing written", tensor=info.name,
                           code="D106")


def by_input_offset(items, info_of) -> list:
    """``items`` in the order their tensors lie in the input (file, then offset): sequential reads."""
    return sorted(items, key=lambda x: (str(info_of(x).file), info_of(x).begin))
