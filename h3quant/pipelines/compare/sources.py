"""Open any file a user holds for the forward: safetensors files and shards as they are, a GGUF
file through a temporary float safetensors copy (``formats.gguf.export``), removed after."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from h3quant.formats.gguf.reader import is_gguf


@contextlib.contextmanager
def forward_path(path: str | os.PathLike, workdir: str | None = None, on_tensor=None):
    """A path ``H3Model.open`` reads: ``path`` itself, or a float copy of a GGUF file."""
    if not is_gguf(path):
        yield str(path)
        return
    from h3quant.formats.gguf.export import to_safetensors

    with tempfile.TemporaryDirectory(prefix="h3quant-gguf-", dir=workdir) as d:
        out = Path(d) / (Path(path).stem + ".safetensors")
        to_safetensors(path, out, on_tensor=on_tensor)
        yield str(out)
