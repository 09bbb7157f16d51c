"""A checkpoint's identity for calibration statistics: a checksum of its safetensors headers.

The header of a safetensors file lists every tensor's name, dtype, shape and byte range (and
the file's metadata), so two files with the same header checksum hold the same tensor set laid
out the same way; statistics measured on one are refused for any other. Only the headers are
read (a few kB to a few MB), never the weights: a re-saved file with identical tensor bytes but
another header counts as another checkpoint, which errs on the safe side.
"""

from __future__ import annotations

import hashlib
import os
import struct

from h3quant.formats.container.checkpoint import Checkpoint


def header_checksum(ckpt: Checkpoint) -> str:
    """``sha256:<hex>`` over every file's header bytes (length prefix included), in the
    checkpoint's file order (shards sorted by name)."""
    h = hashlib.sha256()
    for sf in ckpt.files:
        with open(sf.path, "rb") as fh:
            raw = fh.read(8)
            (n,) = struct.unpack("<Q", raw)
            h.update(raw)
            h.update(fh.read(min(n, sf.header_len)))
        h.update(os.path.basename(sf.path).encode() if len(ckpt.files) > 1 else b"")
    return "sha256:" + h.hexdigest()


def gguf_header_checksum(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` over a GGUF file's header (everything before its tensor data)."""
    from h3quant.formats.gguf.reader import GgufFile

    with GgufFile(path) as g:
        length = g.header_length
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(length))
    return "sha256:" + h.hexdigest()


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """``header_checksum`` of the checkpoint at ``path`` (file, shard index or directory; a
    GGUF file: its header's checksum)."""
    from h3quant.formats.gguf.reader import is_gguf

    if is_gguf(path):
        return gguf_header_checksum(path)
    with Checkpoint(path) as ckpt:
        return header_checksum(ckpt)


__all__ = ["checkpoint_fingerprint", "gguf_header_checksum", "header_checksum"]
