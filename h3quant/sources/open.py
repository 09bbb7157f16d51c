"""Open any checkpoint a user holds for reading its tensors: a safetensors file, shard index or
directory as a ``Checkpoint``, a GGUF file as a ``GgufView`` (the same reading interface,
dequantized in place, nothing written)."""

from __future__ import annotations

import os

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.gguf.reader import is_gguf


def open_source(path: str | os.PathLike, *, mmap: bool = True):
    """A ``Checkpoint`` of ``path``, or a ``GgufView`` when it is a GGUF file."""
    if is_gguf(path):
        from h3quant.sources.gguf_view import GgufView

        return GgufView(path)
    return Checkpoint(path, mmap=mmap)
