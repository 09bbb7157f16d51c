"""Every file a source reads, for the rule that no output names an input."""

from __future__ import annotations

from pathlib import Path

from h3quant.formats.container.checkpoint import Checkpoint


def input_paths(ckpt: Checkpoint, src: Path) -> list[Path]:
    """Every path the conversion reads: the named input, its shards and its index."""
    files = getattr(ckpt, "input_files", None)  # a SourceView: the real files behind it
    if files is None:
        files = [sf.path for sf in ckpt.files] + ([ckpt.index_path] if ckpt.index_path else [])
    return [src] + list(files)
