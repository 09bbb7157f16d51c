"""``convert`` from a GGUF file: the GGUF tensors are dequantized by the gguf package into a
temporary float32 safetensors copy (ComfyUI's names) beside OUT, which ``convert`` then reads
as its IN with the same options; the copy is removed afterwards, whatever happens."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from h3quant.cli.common import guard, log
from h3quant.errors import OutputError


def from_gguf(ctx, src: str, dst: str, quiet: bool) -> None:
    from h3quant.formats.gguf.export import to_safetensors

    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise OutputError("OUT is IN: the output may not name an input file", path=dst)
    parent = Path(dst).resolve().parent
    if not parent.is_dir():
        raise OutputError("the output's directory does not exist", path=dst)
    with tempfile.TemporaryDirectory(prefix=".h3quant-gguf-", dir=parent) as d:
        copy = Path(d) / (Path(src).stem + ".safetensors")
        if not quiet:
            log(f"reading GGUF {src}: dequantizing every tensor to a float32 copy ({copy.name})")
        guard("reading the GGUF file", to_safetensors, src, copy)
        ctx.invoke(ctx.command, **{**ctx.params, "src": str(copy)})
