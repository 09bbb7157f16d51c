"""The naming of a checkpoint for ``inspect`` and ``validate`` (FORMATS.md 12).

``summary`` says which naming a checkpoint uses (ComfyUI, official shards, diffusers shards)
and whether it holds scaled fp8 weights. ``view`` gives the tensors as ComfyUI names them
(what ``convert`` reads through its view), so the H3 topology rules run on official, diffusers and fp8
files too; the naming rules (N301-N305) are raised as ``FormatError`` with their code.
"""

from __future__ import annotations

from types import SimpleNamespace

from h3quant.errors import FormatError
from h3quant.h3 import naming
from h3quant.findings import Finding
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.markers import HEADER_KEY
from h3quant.sources.header import check_scale, has_config
from h3quant.sources.header import headers as _headers


def _shards(ckpt: Checkpoint) -> list[str] | None:
    return [sf.path.name for sf in ckpt.files] if ckpt.is_sharded else None



def summary(ckpt: Checkpoint) -> dict:
    """{naming, evidence, fp8_scaled, error}: ``error`` holds a naming rule's code and message
    when the file breaks one (``validate`` lists it)."""
    tensors = _headers(ckpt)
    scaled = sorted(naming.fp8_scaled_weights(tensors))
    try:
        det = naming.detect(tensors, _shards(ckpt), has_config(ckpt))
        mapping = naming.plan_mapping(tensors, det.naming)
        naming.check_fp8_scales(mapping, tensors)
    except FormatError as exc:
        return {"naming": None, "evidence": None, "fp8_scaled": len(scaled),
                "error": {"code": exc.code, "message": exc.reason, "tensor": exc.tensor}}
    return {"naming": det.naming, "evidence": det.evidence, "fp8_scaled": len(scaled),
            "unused": mapping.unused, "error": None}


def view(ckpt: Checkpoint) -> tuple[str, dict | None]:
    """(naming, ComfyUI-named tensors) where the file is not a plain ComfyUI one, else
    (``comfy``, None). Raises ``FormatError`` (N301-N305)."""
    tensors = _headers(ckpt)
    det = naming.detect(tensors, _shards(ckpt), has_config(ckpt))
    mapping = naming.plan_mapping(tensors, det.naming)
    naming.check_fp8_scales(mapping, tensors)
    if mapping.trivial:
        return det.naming, None
    return det.naming, {n: SimpleNamespace(name=n, dtype=d, shape=s)
                        for n, (d, s) in naming.staged_entries(mapping).items()}


def check_scale_values(ckpt: Checkpoint) -> None:
    """``--deep``: every fp8 scale is finite and positive (N305)."""
    import torch

    tensors = _headers(ckpt)
    for w in sorted(naming.fp8_scaled_weights(tensors)):
        stem = w[: -len(".weight")]
        for s in naming.FP8_SCALES:
            if f"{stem}.{s}" not in tensors:
                continue
            check_scale(ckpt.read(f"{stem}.{s}").to(torch.float32), f"{stem}.{s}")



def fp8_scaled(ckpt: Checkpoint) -> set[str]:
    """Weights (and their layers) in ComfyUI's scaled-fp8 layout."""
    weights = naming.fp8_scaled_weights(_headers(ckpt))
    return weights | {w[: -len(".weight")] for w in weights}


def scaled_fp8_findings(ckpt: Checkpoint) -> list[Finding]:
    """Q131: ComfyUI's ``scaled_fp8`` marker present exactly where it is true. ComfyUI's loader
    (``comfy/utils.py`` ``convert_old_quants``) multiplies ``scale_weight`` into fp8 weights only
    when the marker is there and the header has no ``_quantization_metadata``."""
    tensors = _headers(ckpt)
    markers = sorted(n for n in tensors if naming.is_scaled_fp8_marker(n))
    legacy = sorted(naming.legacy_scaled(tensors))
    header = HEADER_KEY in ckpt.metadata
    out = []
    if legacy and not markers:
        out.append(Finding("Q131", f"{len(legacy)} fp8 weight(s) with scale_weight but no "
                           "scaled_fp8 marker tensor: ComfyUI loads their codes unscaled and "
                           "scale_weight as unexpected keys", tensor=legacy[0]))
    for m in markers:
        if not legacy:
            out.append(Finding("Q131", "scaled_fp8 marker in a file without scale_weight fp8 "
                               "layers: ComfyUI reports it as an unexpected key", tensor=m))
        elif header:
            out.append(Finding("Q131", f"scaled_fp8 marker beside {HEADER_KEY}: ComfyUI then "
                               "ignores the marker (an unexpected key) and loads the "
                               "scale_weight layers unscaled", tensor=m))
    return out
