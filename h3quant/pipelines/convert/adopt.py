"""Take in official, diffusers and fp8 checkpoints: re-lay them out as ComfyUI's single file.

``convert`` calls ``adopt_mapping`` on its input's header; when the input is not already a
ComfyUI file with plain (non-fp8) weights, ``stage`` writes the equivalent ComfyUI file into a
private staging directory beside the output, one target tensor at a time (a fused q/k/v reads
its three sources, nothing else), and the ordinary conversion runs on that file. Converting an
official or diffusers checkpoint therefore gives exactly the bytes converting the ComfyUI file
gives. The staging directory is removed on success, error or interrupt.

Row operations (``formats.rules.naming``) move whole rows, so a BF16 source stays bit-exact. fp8
weights are decoded exactly to fp32 (``float(code) * scale``, the scale per tensor or per
output row, as ComfyUI's scaled-fp8 loader multiplies it in) and staged as F32 for a quantized
target, or rounded once to BF16 (nearest even) for ``--to bf16``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from h3quant.errors import FormatError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.rules.naming import (
    DEINTERLEAVE_QKV,
    FUSE_QKV,
    SWAP_HALVES,
    Detection,
    Mapping,
    Target,
    check_fp8_scales,
    detect,
    is_fp8_weight,
    plan_mapping,
    staged_entries,
)
from h3quant.pipelines.naming_view import has_config
from h3quant.formats.container.writer import Entry, Layout, StreamingWriter, plan_layout



def adopt_mapping(ckpt: Checkpoint, naming: str = "auto") -> tuple[Detection, Mapping]:
    """The input's naming (detected, or ``naming``) and its map onto ComfyUI's names."""
    tensors = {n: (t.dtype, tuple(t.shape)) for n, t in ckpt.tensors.items()}
    det = detect(tensors, [sf.path.name for sf in ckpt.files] if ckpt.is_sharded else None,
                 has_config(ckpt))
    if naming != "auto":
        det = Detection(naming, "chosen with --naming", det.fp8)
    mapping = plan_mapping(tensors, det.naming)
    check_fp8_scales(mapping, tensors)
    return det, mapping


def staged_layout(mapping: Mapping, metadata: dict[str, str], quantized_target: bool) -> Layout:
    entries = [Entry(n, d, sh) for n, (d, sh) in
               staged_entries(mapping, quantized_target).items()]
    return plan_layout(entries, dict(metadata))


def decode_fp8(ckpt: Checkpoint, src):
    """fp8 codes -> exact fp32, the scale (per tensor or per row) multiplied in."""
    import torch

    w = ckpt.read(src.name).to(torch.float32)
    if src.scale is None:
        return w
    s = ckpt.read(src.scale).to(torch.float32)
    bad = ~torch.isfinite(s) | (s <= 0)
    if bool(bad.any()):
        raise FormatError(f"[N305] fp8 scale holds {int(bad.sum())} non-finite, zero or negative "
                          "value(s); nothing written", tensor=src.scale, code="N305")
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape((-1,) + (1,) * (w.dim() - 1))


def _read(ckpt: Checkpoint, src):
    return decode_fp8(ckpt, src) if is_fp8_weight(src.name, src.dtype) else ckpt.read(src.name)


def build_target(ckpt: Checkpoint, t: Target):
    """The ComfyUI tensor ``t`` from its sources (rows moved, never recomputed)."""
    import torch

    if t.op == FUSE_QKV:
        return torch.cat([_read(ckpt, s) for s in t.sources], dim=0)
    x = _read(ckpt, t.sources[0])
    if t.op == SWAP_HALVES:
        half = x.shape[0] // 2
        return torch.cat([x[half:], x[:half]], dim=0)
    if t.op == DEINTERLEAVE_QKV:
        rows = x.shape[0]
        d = rows // (3 * t.heads)
        return x.reshape(t.heads, 3, d, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    return x


def stage(ckpt: Checkpoint, mapping: Mapping, path: Path, quantized_target: bool) -> Path:
    """Write the ComfyUI file of ``mapping`` to ``path`` (streamed, atomic)."""
    from h3quant.formats.container.dtypes import to_torch

    layout = staged_layout(mapping, ckpt.metadata, quantized_target)
    by_name = {t.name: t for t in mapping.targets}
    with StreamingWriter(path, layout) as w:
        for entry in layout.order:
            x = build_target(ckpt, by_name[entry.name])
            want = to_torch(entry.dtype)
            if x.dtype != want:
                x = x.to(want)  # fp8 decoded: F32 kept, or rounded once to BF16
            w.write_tensor(entry.name, x.contiguous())
            del x
    return path


def staged_name(src: Path) -> str:
    """The staged file's name: the input's, so the output's provenance names the input."""
    return src.name if src.name.endswith(".safetensors") else src.name + ".safetensors"


@contextmanager
def staging_dir(dst: Path):
    """A private directory beside ``dst`` (same file system), removed on the way out."""
    parent = dst.parent if str(dst.parent) else Path(".")
    d = Path(tempfile.mkdtemp(prefix=f".{dst.name}.staging-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def header_only(mapping: Mapping, metadata: dict[str, str], quantized_target: bool,
                path: Path) -> Path:
    """A sparse file holding the staged header and no data, for planning (``--dry-run``)."""
    layout = staged_layout(mapping, metadata, quantized_target)
    with open(path, "wb") as f:
        f.write(layout.header)
        f.truncate(layout.file_bytes)
    os.chmod(path, 0o600)
    return path
