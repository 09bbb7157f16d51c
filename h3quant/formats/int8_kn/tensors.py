"""The NPU pre-transposed int8 layout ``int8_tensorwise_kn`` (FORMATS.md section 9).

A kn layer stores exactly the transpose of the canonical int8_tensorwise codes: ``weight I8 [K, N]``
C-contiguous and ``weight_scale F32 [N]``; math, rotation and scales are those of int8_tensorwise.
The format has its own name so that a reader that only knows int8_tensorwise fails loudly instead
of mis-reading the transposed weight (for a square layer no shape check would catch it).

``RowTransposer`` writes the transpose of a ``[rows, cols]`` int8 matrix that arrives in row order
(in any chunk sizes) as byte ranges of the ``[cols, rows]`` output: it buffers at most
``buffer_bytes`` of input rows, transposes that slab and hands each output row's piece to a
``write(offset, bytes)`` callback. Memory is two slabs, whatever the tensor size, and every
relayout (canonical -> kn, kn -> canonical, freshly encoded codes -> kn) goes through it.
No devices, no files: pure tensor and byte work. Importing this module does not import torch
(inspect and validate read only headers); the transposer imports it when built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from h3quant.convrot import check_group_size
from h3quant.errors import FormatError

if TYPE_CHECKING:
    import torch

from h3quant.formats.int8.spec import NAME as CANONICAL  # noqa: E402  (the math it re-lays out)

FORMAT = "int8_tensorwise_kn"
LAYOUTS = ("canonical", "npu")  # convert --layout values
TRANSPOSE_BYTES = 64 << 20  # input slab of a chunked transpose
NZ_FORMAT = 29  # ACL_FORMAT_FRACTAL_NZ, the id npu_format_cast takes
NZ_K_MULTIPLE = 16  # int8 FRACTAL_NZ: K % 16 == 0 ...
NZ_N_MULTIPLE = 32  # ... and N % 32 == 0, else the weight stays ND
NPU_MAX_N = 65535  # npu_quant_matmul's limit on N per rank


def kn_marker(convrot: bool = True, group_size: int = 256) -> dict:
    """The canonical kn marker: the int8 one with the format name changed (key order kept)."""
    if not convrot:
        return {"format": FORMAT}
    check_group_size(group_size)
    return {"format": FORMAT, "convrot": True, "convrot_groupsize": int(group_size)}


def nz_eligible(n: int, k: int) -> bool:
    """Whether a ``[K, N]`` int8 weight can be cast to FRACTAL_NZ (FORMATS.md 6)."""
    return k % NZ_K_MULTIPLE == 0 and n % NZ_N_MULTIPLE == 0


def nz_reason(n: int, k: int) -> str | None:
    """Why a ``[K, N]`` int8 weight stays ND (None when NZ-eligible)."""
    bad = []
    if k % NZ_K_MULTIPLE:
        bad.append(f"K={k} % {NZ_K_MULTIPLE} != 0")
    if n % NZ_N_MULTIPLE:
        bad.append(f"N={n} % {NZ_N_MULTIPLE} != 0")
    return " and ".join(bad) or None


MAX_TP_DEGREE = 64


def tp_degree_for(n: int, limit: int = NPU_MAX_N) -> int | None:
    """The smallest tensor-parallel degree (column split of N, at most MAX_TP_DEGREE ranks)
    giving every rank ``<= limit`` outputs in equal whole shards, or None when none fits."""
    if n <= limit:
        return 1
    for d in range(-(-n // limit), MAX_TP_DEGREE + 1):
        if n % d == 0 and n // d <= limit:
            return d
    return None


def check_kn(layer, n: int | None, k: int | None, *, file: str | None = None) -> list:
    """Header-only kn rules of one layer (``n``, ``k`` from its stored ``[K, N]`` weight):
    Q109 scale [N] against the weight, Q110 FRACTAL_NZ eligibility (a note), Q111 N per rank."""
    from h3quant.findings import Finding

    out: list[Finding] = []
    w, s = layer.weight, layer.tensors.get("weight_scale")
    if w is None or n is None or k is None or len(w.shape) != 2:
        return out
    if s is not None and tuple(s.shape) != (n,):
        shape = list(s.shape)
        if s.numel == k and k != n:
            why = (f"it holds K={k} values: the weight looks stored canonical [N, K] under a kn "
                   "marker (or the scale belongs to another layout)")
        elif s.numel == n:
            why = "it holds N values but is not 1-D (npu_quant_matmul takes a 1-D [N] scale)"
        else:
            why = f"it holds {s.numel} values"
        out.append(Finding("Q109", f"weight_scale is {shape} but the weight is I8 [K, N] = "
                           f"[{k}, {n}], so it must be F32 [{n}]; {why}",
                           tensor=layer.tensor_name("weight_scale"), file=file))
    reason = nz_reason(n, k)
    if reason:
        out.append(Finding("Q110", f"{reason}: the NPU keeps this weight ND (no FRACTAL_NZ cast); "
                           "it runs, with less efficient tiling", tensor=layer.tensor_name("weight"),
                           file=file))
    if n > NPU_MAX_N:
        d = tp_degree_for(n)
        fit = (f"tensor parallelism over {d} ranks (N/{d} = {n // d} per rank) would fit" if d
               else "no equal split of N fits")
        out.append(Finding("Q111", f"N={n} outputs exceed npu_quant_matmul's {NPU_MAX_N} per "
                           f"rank; {fit}, else the layer runs dequantized",
                           tensor=layer.tensor_name("weight"), file=file))
    return out


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


__all__ = [
    "CANONICAL",
    "FORMAT",
    "LAYOUTS",
    "NPU_MAX_N",
    "NZ_FORMAT",
    "TRANSPOSE_BYTES",
    "RowTransposer",
    "check_kn",
    "kn_marker",
    "nz_eligible",
    "nz_reason",
    "tp_degree_for",
    "transpose_stream",
]
