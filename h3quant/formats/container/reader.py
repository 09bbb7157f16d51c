"""Validating safetensors reader with lazy per-tensor reads (mmap or plain buffered reads).

The header is never trusted (FORMATS.md 1): its length is bounded, it must be UTF-8 JSON, every
entry is checked and every offset pair must lie inside the buffer with exactly the right byte
length and no overlaps. Problems become `Finding`s; in strict mode the first error raises
`ContainerError`. Tensor data is read only when asked for, one tensor at a time.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant.errors import ContainerError
from h3quant.findings import Finding, Severity
from h3quant.formats.container import jsonsafe
from h3quant.formats.container.dtypes import DTYPES, itemsize, to_torch
from h3quant.formats.container.platform import open_fd, read_ahead
from h3quant.formats.container.mapping import MappedWindows

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100_000_000
COPY_CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; ``begin``/``end`` are absolute offsets in ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_shape(shape: object) -> bool:
    return isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    )


def _is_offsets(offs: object) -> bool:
    return (
        isinstance(offs, list)
        and len(offs) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
    )


@dataclass
class ParsedHeader:
    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    findings: list[Finding] = field(default_factory=list)


def _looks_like_text(raw: bytes) -> bool:
    """Eight bytes of printable ASCII (a JSON, YAML or text file): never a real header length,
    whose top bytes are zero for any header under ``MAX_HEADER_BYTES``."""
    return len(raw) == 8 and all(32 <= b < 127 or b in (9, 10, 13) for b in raw)


def parse_header(raw_len: bytes, read_header, file_size: int, path: Path) -> ParsedHeader:
    """Check and parse a header. ``read_header(n)`` returns the ``n`` header bytes."""
    name = str(path)
    found: list[Finding] = []

    def fail(code: str, msg: str, tensor: str | None = None) -> ParsedHeader:
        found.append(Finding(code, msg, tensor=tensor, file=name))
        return ParsedHeader(0, {}, {}, found)

    if len(raw_len) < 8:
        return fail("C101", f"file is {file_size} bytes, too short to hold the 8-byte header length")
    (n,) = struct.unpack("<Q", raw_len)
    if (n > MAX_HEADER_BYTES or 8 + n > file_size) and _looks_like_text(raw_len):
        return fail("C101", f"not a safetensors file: it begins with text "
                    f"({raw_len.decode('ascii')!r}), where a safetensors file begins with its "
                    "8-byte header length" + (
                        "; it looks like JSON (a shard index is read through its directory or "
                        "its *.safetensors.index.json name)" if raw_len[:1] in b"{[" else ""))
    if n > MAX_HEADER_BYTES:
        return fail("C101", f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte bound")
    if 8 + n > file_size:
        return fail("C101", f"header length {n} runs past the end of the {file_size}-byte file")
    raw = read_header(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return fail("C102", f"header is not UTF-8 ({exc.reason} at byte {exc.start})")
    try:
        obj = jsonsafe.loads(text)
    except ValueError as exc:
        return fail("C103", f"header is not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return fail("C103", f"header JSON is a {type(obj).__name__}, expected an object")
    if n % 8:
        found.append(Finding("C113", f"header length {n} is not a multiple of 8", file=name))

    metadata: dict[str, str] = {}
    meta = obj.pop("__metadata__", None)
    if meta is not None:
        if isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()):
            metadata = meta
        else:
            found.append(Finding("C110", "__metadata__ must map strings to strings", file=name))

    buffer_len = file_size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    max_end = 0
    for tname, entry in obj.items():
        def bad(code: str, msg: str) -> None:
            found.append(Finding(code, msg, tensor=tname, file=name))

        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            bad("C104", "entry must be an object with dtype, shape and data_offsets")
            continue
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            bad("C105", f"unknown dtype {dtype!r}")
            continue
        if not _is_shape(shape):
            bad("C104", f"shape {shape!r} is not a list of non-negative integers")
            continue
        if not _is_offsets(offs) or not 0 <= offs[0] <= offs[1]:
            bad("C106", f"data_offsets {offs!r} is not a pair 0 <= begin <= end")
            continue
        begin, end = offs
        expected = math.prod(shape) * itemsize(dtype)
        if end - begin != expected:
            bad("C107", f"holds {end - begin} bytes, but {dtype} {shape} needs {expected}")
            continue
        max_end = max(max_end, end)
        if end > buffer_len:
            # Reported in bulk below as truncation; keep the entry out of the readable set.
            spans.append((begin, end, tname))
            continue
        spans.append((begin, end, tname))
        tensors[tname] = TensorInfo(tname, dtype, tuple(shape), 8 + n + begin, 8 + n + end, path)

    if max_end > buffer_len:
        short = [t for b, e, t in spans if e > buffer_len]
        found.append(Finding(
            "C109",
            f"data buffer is {buffer_len} bytes but tensors need {max_end}: file truncated "
            f"({len(short)} tensor(s) unreadable, first: {short[0]})",
            file=name,
        ))
        for t in short:
            tensors.pop(t, None)
    spans.sort()
    covered = 0
    for begin, end, tname in spans:
        if begin < covered and end > begin:
            found.append(Finding("C108", f"bytes [{begin}, {end}) overlap an earlier tensor",
                                 tensor=tname, file=name))
            tensors.pop(tname, None)
        elif begin > covered:
            found.append(Finding("C111", f"{begin - covered} unused bytes before this tensor",
                                 tensor=tname, file=name))
        covered = max(covered, end)
    if covered < buffer_len and not any(f.code == "C109" for f in found):
        found.append(Finding("C111", f"{buffer_len - covered} trailing bytes after the last tensor",
                             file=name))
    return ParsedHeader(n, metadata, tensors, found)


def raise_first_error(findings: list[Finding]) -> None:
    for f in findings:
        if f.severity is Severity.ERROR:
            raise ContainerError(f.message, path=f.file, tensor=f.tensor, code=f.code)


def open_input(path: Path, *, what: str = "input"):
    """Open an input for unbuffered reading, refusing anything but a regular file before any
    read: a FIFO, socket or device could block forever or never end. The open itself cannot
    block (``O_NONBLOCK``); the type is checked on the opened descriptor, so a path swapped
    between the check and the read is still refused."""
    try:
        fd = open_fd(path, os.O_RDONLY, nonblocking=True)
    except OSError as exc:
        raise ContainerError(f"cannot open: {exc.strerror}", path=path, code="C112") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)"
                    if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise ContainerError(f"the {what} is {kind}, not a regular file; refused before "
                                 "reading", path=path, code="C112")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


_RETRY = ("Another program is writing it (a download or copy still running?): run again once "
          "it has finished")


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one opened: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_identity(path: Path, fd: int, opened: tuple[int, int, int, int], *,
                   size_only: bool = False) -> None:
    """``ContainerError`` (C109) when the input open as ``fd`` changed size, was modified, or
    ``path`` no longer names it (replaced or removed), against ``identity()`` taken at open;
    ``size_only`` checks the size alone."""
    st = os.fstat(fd)
    now = identity(st)
    if now[2] != opened[2]:
        raise ContainerError(f"the file changed size while being read ({opened[2]} "
                             f"-> {now[2]} bytes); nothing was written. {_RETRY}", path=path,
                             code="C109")
    if not size_only and now != opened:
        raise ContainerError(f"the file was modified while being read; nothing was written. "
                             f"{_RETRY}", path=path, code="C109")
    try:
        cur = os.stat(path)
    except OSError:
        cur = None
    if not size_only and (cur is None or (cur.st_dev, cur.st_ino) != now[:2]):
        raise ContainerError("the file was replaced or removed while being read; nothing "
                             f"was written. {_RETRY}", path=path, code="C109")


class SafetensorsFile:
    """One .safetensors file. ``mmap=False`` reads with plain buffered I/O (no page-fault stalls).

    Memory-mapped reads map a window per read (the bytes asked for, widened to the platform's
    mapping granularity), never the whole file: a private writable mapping is charged against
    the operating system's commit limit (Linux's overcommit heuristic refuses one larger than
    RAM plus swap, Windows charges it to the page file), so a whole-file mapping of a checkpoint
    larger than memory fails before anything is read. A window lives as long as the tensors
    that view it and is unmapped with them.
    """

    def __init__(self, path: str | os.PathLike, *, mmap: bool = True, strict: bool = True):
        self.path = Path(path)
        self.use_mmap = mmap
        self._windows = MappedWindows(self.path)
        # Unbuffered: a header-only command reads exactly the header bytes, no read-ahead.
        self._fh = open_input(self.path)
        try:
            st = os.fstat(self._fh.fileno())
            self.file_size = st.st_size
            self._identity = identity(st)
            raw_len = self._fh.read(8)
            parsed = parse_header(raw_len, self._read_exact, self.file_size, self.path)
        except OSError as exc:
            self._fh.close()
            raise ContainerError(f"cannot read: {exc.strerror}", path=self.path, code="C112") from None
        self.header_len = parsed.header_len
        self.metadata = parsed.metadata
        self.tensors = parsed.tensors
        self.findings = parsed.findings
        if strict:
            try:
                raise_first_error(self.findings)
            except ContainerError:
                self.close()
                raise

    def check_unchanged(self, *, size_only: bool = False) -> None:
        """Raise ``ContainerError`` when the file was replaced, truncated or rewritten since it
        was opened. Called before every memory-mapped read: reading a mapped page past a
        shrunk end would kill the process with SIGBUS instead of an error."""
        check_identity(self.path, self._fh.fileno(), self._identity, size_only=size_only)

    def _read_exact(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            part = self._fh.read(n - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    # -- data access -------------------------------------------------------------------------
    def fileno(self) -> int:
        """The open file's descriptor (for kernel-side copies of tensor bytes)."""
        return self._fh.fileno()

    def read_bytes(self, info: TensorInfo, start: int = 0, length: int | None = None):
        """Bytes of one tensor (or a slice of them): a memoryview (mmap) or a bytearray."""
        length = info.nbytes - start if length is None else length
        offset = info.begin + start
        if self.use_mmap and length:
            self.check_unchanged(size_only=True)
            return self._windows.view(self._fh.fileno(), offset, length, info.name)
        buf = bytearray(length)
        view = memoryview(buf)
        self._fh.seek(offset)
        got = 0
        while got < length:  # a raw read returns at most ~2 GB, or less near EOF
            n = self._fh.readinto(view[got:])
            if not n:
                raise ContainerError(f"short read: {got} of {length} bytes", path=self.path,
                                     tensor=info.name, code="C109")
            got += n
        return buf

    def release_pages(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        """Let the kernel drop the mapped pages of a byte range (keeps RSS flat while streaming).

        Safe on these private mappings because h3quant never writes to them: dropped pages are
        read again from the file if touched.
        """
        length = info.nbytes - start if length is None else length
        self._windows.advise("MADV_DONTNEED", info.begin + start, length)

    def prefetch(self, info: TensorInfo, start: int = 0, length: int | None = None) -> None:
        """Ask the kernel to start reading a byte range ahead of use (mmap only)."""
        if not self.use_mmap:
            return
        length = info.nbytes - start if length is None else length
        read_ahead(self._fh.fileno(), info.begin + start, length)

    def iter_bytes(self, info: TensorInfo, chunk: int = COPY_CHUNK) -> Iterator:
        """The tensor's bytes in chunks of at most ``chunk`` bytes (bounded memory)."""
        for start in range(0, info.nbytes, chunk):
            yield self.read_bytes(info, start, min(chunk, info.nbytes - start))

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor (CPU). In mmap mode it may share memory with a private mapping."""
        import torch

        dtype = to_torch(info.dtype)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        data = self.read_bytes(info)
        if isinstance(data, memoryview) and info.begin % itemsize(info.dtype):
            data = bytearray(data)  # keep element access aligned
        flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        return flat.reshape(info.shape)

    def close(self) -> None:
        self._windows.close()
        self._fh.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
