"""A GGUF file as a float safetensors file with ComfyUI's names: every quantized tensor
dequantized by the gguf package to float32 (exact: the package computes in float32), F32 and
F16 tensors copied, BF16 widened to float32 (exact). Streamed tensor by tensor (memory: one
tensor) through the container's atomic writer. The h3quant forward, ``convert`` and ``compare``
read GGUF files this way."""

from __future__ import annotations

import os

from h3quant.formats.container.writer import Entry, StreamingWriter, plan_layout
from h3quant.formats.gguf.reader import GgufFile

METADATA_KEY = "h3quant.gguf_source"


def _dtype(qtype: str) -> str:
    return "F16" if qtype == "F16" else "F32"


def to_safetensors(src: str | os.PathLike, dst: str | os.PathLike, *, on_tensor=None) -> int:
    """Write ``src`` (GGUF) to ``dst`` (safetensors, float); returns the bytes written.
    ``on_tensor(done, total)`` is called after each tensor (progress)."""
    import json

    import numpy as np

    with GgufFile(src) as g:
        names = sorted(g.tensors)
        entries = [Entry(n, _dtype(g.tensors[n].qtype), g.tensors[n].shape) for n in names]
        types: dict[str, int] = {}
        for t in g.tensors.values():
            types[t.qtype] = types.get(t.qtype, 0) + 1
        meta = {METADATA_KEY: json.dumps({"file": os.path.basename(str(src)),
                                          "architecture": g.architecture, "types": types},
                                         sort_keys=True)}
        layout = plan_layout(entries, meta)
        with StreamingWriter(dst, layout) as w:
            for k, e in enumerate(layout.order):
                a = g.read(e.name)
                a = a.astype(np.float16 if e.dtype == "F16" else np.float32, copy=False)
                if e.nbytes:
                    w.write(e.name, np.ascontiguousarray(a).view(np.uint8).reshape(-1))
                del a
                if on_tensor is not None:
                    on_tensor(k + 1, len(layout.order))
        return layout.file_bytes
