"""What the card says about a file before any forward: container, size, bits per weight of the
DiT block linears, the mix of formats; and which of several files is the most precise (the
reference when none is named)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from h3quant.formats.gguf.reader import GgufFile, is_gguf


@dataclass
class FileFacts:
    path: str
    container: str  # "safetensors" or "gguf"
    size_bytes: int
    bits_per_weight: float | None  # stored bits per logical weight of the DiT block linears
    formats: dict[str, int] = field(default_factory=dict)  # format -> block linears

    @property
    def quantized(self) -> bool:
        return any(not f.startswith("float:") for f in self.formats)

    @property
    def label(self) -> str:
        """The formats in a few words: ``int8_tensorwise``, ``gguf:Q4_K 75% + gguf:Q6_K 25%``."""
        total = sum(self.formats.values()) or 1
        items = sorted(self.formats.items(), key=lambda kv: (-kv[1], kv[0]))
        if len(items) == 1:
            return items[0][0]
        return " + ".join(f"{k} {100 * v / total:.0f}%" for k, v in items)

    def to_dict(self) -> dict:
        return {"path": self.path, "container": self.container, "size_bytes": self.size_bytes,
                "bits_per_weight": self.bits_per_weight, "formats": dict(self.formats)}


def _size(path: str) -> int:
    from h3quant.formats.container.checkpoint import Checkpoint

    if is_gguf(path):
        return os.path.getsize(path)
    with Checkpoint(path) as ck:
        return ck.total_bytes


def file_facts(path: str | os.PathLike) -> FileFacts:
    """Facts from the header alone (no tensor data is read)."""
    from h3quant.h3.topology import is_h3_block_linear

    path = str(path)
    formats: dict[str, int] = {}
    bits = elems = 0
    if is_gguf(path):
        with GgufFile(path) as g:
            for name, t in g.tensors.items():
                if name.endswith(".weight") and is_h3_block_linear(name[:-len(".weight")]):
                    key = "gguf:" + t.qtype if t.quantized else "float:" + t.qtype
                    formats[key] = formats.get(key, 0) + 1
                    bits += 8 * t.nbytes
                    elems += t.numel
        return FileFacts(path, "gguf", os.path.getsize(path), bits / elems if elems else None,
                         formats)
    from h3quant.formats import registry
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.layers import scan_checkpoint

    with Checkpoint(path) as ck:
        scan = scan_checkpoint(ck)
        for name, lay in scan.layers.items():
            if not is_h3_block_linear(name) or lay.weight is None:
                continue
            key = lay.fields["format"] if lay.fields else "float:" + lay.weight.dtype
            formats[key] = formats.get(key, 0) + 1
            n, k = registry.logical_shape(lay.weight.shape, lay.fields)
            bits += 8 * sum(t.nbytes for s, t in lay.tensors.items()
                            if s not in ("comfy_quant", "bias"))
            elems += n * k
        size = ck.total_bytes
    return FileFacts(path, "safetensors", size, bits / elems if elems else None, formats)


def pick_reference(facts: list[FileFacts]) -> FileFacts:
    """The most precise file: a float file first (the widest), else the most bits per weight;
    ties go to the first given."""
    def key(f: FileFacts):
        return (0 if not f.quantized else 1, -(f.bits_per_weight or 0.0))

    return min(facts, key=key)
