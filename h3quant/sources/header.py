"""What a checkpoint's header says about its source layout, read without tensor data: every
tensor's dtype and shape with the layers the header marks, whether a ``config.json`` lies
beside the shards, and the rule on an fp8 scale's values (N305). Torch-free at import; the
header commands read it without the views of ``comfy_view`` and ``gguf_view``."""

from __future__ import annotations

from h3quant.errors import FormatError, MarkerError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.markers import parse_header_metadata
from h3quant.h3 import naming


def header_layers(ckpt: Checkpoint) -> set[str]:
    """Layers the header ``_quantization_metadata`` names (empty when absent or unreadable:
    the marker rules report that)."""
    try:
        return set(parse_header_metadata(ckpt.metadata) or ())
    except MarkerError:
        return set()


def headers(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape), the layers the header marks taken into account."""
    return naming.header_tensors(ckpt.tensors, header_layers(ckpt))


def has_config(ckpt: Checkpoint) -> bool:
    """A ``config.json`` beside the shards (the official release ships one)."""
    return bool(ckpt.files) and (ckpt.files[0].path.parent / "config.json").is_file()


def check_scale(scale, name: str, note: str = "") -> None:
    """N305 unless every value of the fp8 scale tensor ``scale`` is finite and positive."""
    import torch

    bad = int((~torch.isfinite(scale) | (scale <= 0)).sum())
    if bad:
        raise FormatError(f"[N305] fp8 scale holds {bad} non-finite, zero or negative "
                          f"value(s){note}", tensor=name, code="N305")
