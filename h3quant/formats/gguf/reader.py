"""Read a GGUF file's header and tensors (``gguf.GGUFReader``, memory-mapped) with h3quant's
checks: the magic, every shape bounded before any data is read, names unique, one clear error
naming the file and the tensor."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from h3quant.errors import ContainerError, UnsupportedError
from h3quant.formats.gguf.header import MAX_DIMS, MAX_ELEMENTS, check_header
from h3quant.formats.gguf.naming import ORIG_SHAPE_FIELD, comfy_name, uses_prefix
from h3quant.limits import MAX_GGUF_TENSORS as MAX_TENSORS

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file that starts with the GGUF magic."""
    p = Path(path)
    try:
        if not p.is_file():
            return False
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UnsupportedError("reading GGUF files needs the gguf package: pip install "
                               "'h3quant[gguf]' (or pip install gguf)") from None
    return gguf


@dataclass(frozen=True)
class GgufTensor:
    name: str  # ComfyUI's name
    gguf_name: str  # as stored
    qtype: str  # the GGML type's name: F32, F16, BF16, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # the original (torch) shape
    nbytes: int
    index: int  # position in the file's tensor list

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        return self.qtype not in ("F32", "F16", "BF16", "F64")

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0


class GgufFile:
    """One GGUF file: ``version``, ``architecture``, ``metadata`` (scalar and string fields),
    ``tensors`` (ComfyUI name -> GgufTensor) and ``read(name)`` (float32 numpy)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not is_gguf(path):
            raise ContainerError("not a GGUF file (no GGUF magic)", path=path)
        gguf = _gguf()
        check_header(path)  # bounded: counts and lengths against the file and the limits
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except (ValueError, KeyError, IndexError, OSError, TypeError) as e:
            raise ContainerError(f"malformed GGUF header: {e}", path=path) from None
        r = self._reader
        self.version = self._scalar("GGUF.version")
        self.architecture = self._string("general.architecture")
        if len(r.tensors) > MAX_TENSORS:
            raise ContainerError(f"{len(r.tensors)} tensors (at most {MAX_TENSORS})", path=path)
        names = [t.name for t in r.tensors]
        prefix = uses_prefix(names)
        self.tensors: dict[str, GgufTensor] = {}
        for i, t in enumerate(r.tensors):
            name = comfy_name(t.name, prefix)
            if name is None:
                continue
            if name in self.tensors:
                raise ContainerError("the tensor name appears twice", path=path, tensor=t.name)
            shape = self._orig_shape(t.name) or tuple(int(v) for v in reversed(t.shape))
            self._check_shape(t, shape)
            qtype = getattr(t.tensor_type, "name", str(t.tensor_type))
            self.tensors[name] = GgufTensor(name, t.name, qtype, shape, int(t.n_bytes), i)

    @property
    def header_length(self) -> int:
        """Bytes before the tensor data: the magic, metadata and tensor descriptions."""
        return int(self._reader.data_offset)

    # -------------------------------------------------------------------------- header fields
    def _field(self, key):
        return self._reader.get_field(key)

    def _scalar(self, key):
        f = self._field(key)
        if f is None or not f.data:
            return None
        v = f.parts[f.data[-1]]
        return v.tolist()[0] if hasattr(v, "tolist") else v

    def _string(self, key) -> str | None:
        f = self._field(key)
        if f is None or not f.data:
            return None
        try:
            return bytes(f.parts[f.data[-1]]).decode("utf-8")
        except (UnicodeDecodeError, TypeError):
            return None

    @property
    def metadata(self) -> dict[str, object]:
        """Scalar and string fields (arrays summarised by their length)."""
        out: dict[str, object] = {}
        for key, f in self._reader.fields.items():
            if key.startswith(ORIG_SHAPE_FIELD) or key.startswith("GGUF."):
                continue
            if len(f.types) == 1:
                s = self._string(key) if f.types[0].name == "STRING" else self._scalar(key)
                out[key] = s
            else:
                out[key] = f"array[{len(f.data)}]"
        return out

    def _orig_shape(self, name: str) -> tuple[int, ...] | None:
        f = self._field(ORIG_SHAPE_FIELD + name)
        if f is None:
            return None
        try:
            return tuple(int(f.parts[i][0]) for i in f.data)
        except (IndexError, TypeError, ValueError):
            raise ContainerError("malformed original-shape field", path=self.path,
                                 tensor=name) from None

    def _check_shape(self, t, shape) -> None:
        if not 1 <= len(shape) <= MAX_DIMS or any(d < 0 for d in shape):
            raise ContainerError(f"shape {list(shape)} is not a tensor shape", path=self.path,
                                 tensor=t.name)
        n = math.prod(shape)
        if n > MAX_ELEMENTS:
            raise ContainerError(f"{n} elements (at most {MAX_ELEMENTS})", path=self.path,
                                 tensor=t.name)
        if n != int(t.n_elements):
            raise ContainerError(f"shape {list(shape)} holds {n} elements, the tensor "
                                 f"{int(t.n_elements)}", path=self.path, tensor=t.name)

    # ------------------------------------------------------------------------------- data
    @property
    def total_bytes(self) -> int:
        return os.path.getsize(self.path)

    def info(self, name: str) -> GgufTensor:
        info = self.tensors.get(name)
        if info is None:
            raise ContainerError("no such tensor in the GGUF file", path=self.path, tensor=name)
        return info

    def _blocks(self, info: GgufTensor):
        """(raw bytes of the tensor as uint8 numpy over the file's mapping, values per block,
        bytes per block)."""
        import numpy as np

        from gguf.constants import GGML_QUANT_SIZES

        t = self._reader.tensors[info.index]
        sizes = GGML_QUANT_SIZES.get(t.tensor_type)
        if sizes is None:
            raise UnsupportedError(f"GGUF type {info.qtype} has no known block size",
                                   path=self.path, tensor=info.name)
        return np.asarray(t.data).reshape(-1).view(np.uint8), sizes[0], sizes[1]

    def byte_range(self, name: str, first: int, stop: int) -> tuple[int, int]:
        """(offset in the file, length) of the stored blocks holding values
        ``[first, stop)`` (in the original shape's row-major order)."""
        info = self.info(name)
        _, per_block, block_bytes = self._blocks(info)
        b0, b1 = first // per_block, -(-stop // per_block)
        begin = self._reader.tensors[info.index].data_offset
        return begin + b0 * block_bytes, (b1 - b0) * block_bytes

    def read_values(self, name: str, first: int = 0, stop: int | None = None):
        """Values ``[first, stop)`` of the tensor, flat, in the original shape's row-major
        order, as float32 numpy: only the blocks holding them are dequantized (by the gguf
        package's own ``gguf.quants.dequantize``)."""
        import numpy as np

        from gguf.quants import dequantize

        info = self.info(name)
        stop = info.numel if stop is None else stop
        if not 0 <= first <= stop <= info.numel:
            raise ContainerError(f"values [{first}, {stop}) outside the tensor's {info.numel}",
                                 path=self.path, tensor=name)
        if first == stop:
            return np.empty(0, np.float32)
        raw, per_block, block_bytes = self._blocks(info)
        b0, b1 = first // per_block, -(-stop // per_block)
        t = self._reader.tensors[info.index]
        try:
            values = dequantize(raw[b0 * block_bytes:b1 * block_bytes], t.tensor_type)
        except (NotImplementedError, ValueError, KeyError) as e:
            raise UnsupportedError(f"GGUF type {info.qtype} cannot be dequantized by the gguf "
                                   f"package ({e})", path=self.path, tensor=name) from None
        values = values.reshape(-1)[first - b0 * per_block:stop - b0 * per_block]
        return values.astype(np.float32, copy=False)

    def read(self, name: str):
        """The tensor as float32 numpy in its original shape (dequantized by the gguf package's
        own ``gguf.quants.dequantize``)."""
        import numpy as np

        info = self.info(name)
        return np.ascontiguousarray(self.read_values(name).reshape(info.shape))

    def close(self) -> None:
        self._reader = None  # drops the memory map

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
