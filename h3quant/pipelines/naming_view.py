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
from h3quant.formats.container.checkpoint import Checkpoint


def _headers(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in ckpt.tensors.items()}


def _shards(ckpt: Checkpoint) -> list[str] | None:
    return [sf.path.name for sf in ckpt.files] if ckpt.is_sharded else None


def has_config(ckpt: Checkpoint) -> bool:
    """A ``config.json`` beside the shards (the official release ships one)."""
    return bool(ckpt.files) and (ckpt.files[0].path.parent / "config.json").is_file()


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


def check_scale(scale, name: str, note: str = "") -> None:
    """N305 unless every value of the fp8 scale tensor ``scale`` is finite and positive."""
    import torch

    bad = int((~torch.isfinite(scale) | (scale <= 0)).sum())
    if bad:
        raise FormatError(f"[N305] fp8 scale holds {bad} non-finite, zero or negative "
                          f"value(s){note}", tensor=name, code="N305")
