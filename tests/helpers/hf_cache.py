"""A Hugging Face cache laid out in a test: content-addressed blobs and relative links."""

from __future__ import annotations

import hashlib
from pathlib import Path


def hf_cache_snapshot(src_dir: Path, cache: Path, repo: str = "models--MiniMax--H3",
                      subfolder: str = "transformer") -> Path:
    """Lay ``src_dir``'s files out as huggingface_hub's cache does: content-addressed blobs,
    and relative symbolic links to them under ``snapshots/<rev>/<subfolder>/``."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    blobs = cache / repo / "blobs"
    snap = cache / repo / "snapshots" / rev / subfolder
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (cache / repo / "refs").mkdir()
    (cache / repo / "refs" / "main").write_text(rev)
    depth = len(Path(subfolder).parts) + 2  # snapshots/<rev>/<subfolder...>
    for f in sorted(src_dir.iterdir()):
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snap / f.name).symlink_to(Path(*([".."] * depth)) / "blobs" / digest)
    return snap
