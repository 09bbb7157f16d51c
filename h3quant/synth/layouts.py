"""Synthetic H3 checkpoints in the layouts users download (FORMATS.md 12).

``write_layout`` reads a synthetic ComfyUI file one tensor at a time and writes it as:

- ``official``: a directory of ``model-0000N-of-0000M.safetensors`` shards and
  ``model.safetensors.index.json``, same names, each ``attn.qkv_proj`` in per-head
  ``[q_h; k_h; v_h]`` row order;
- ``diffusers``: ``diffusion_pytorch_model-0000N-of-0000M.safetensors`` shards and their index,
  diffusers names, split ``to_q`` / ``to_k`` / ``to_v``, ``ff.net.0.proj`` as ``[value; gate]``
  (``rope.inv_freq`` is kept, as a persistent buffer);
- with ``fp8``, every 2-D BF16 linear of the DiT and refiner blocks as ``float8_e4m3fn`` codes
  with one F32 ``scale_weight`` ``[1]`` per tensor (amax / 448), and the empty ``F8_E4M3``
  ``scaled_fp8`` marker tensor that tells ComfyUI's loader (``comfy/utils.py``
  ``convert_old_quants``) to multiply the scales in: ComfyUI's scaled-fp8 form, as released.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from h3quant.errors import UnsupportedError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.dtypes import to_torch
from h3quant.formats.fp8.spec import SCALED_FP8_MARKER
from h3quant.formats.container.writer import Entry, StreamingWriter, entry_for, plan_layout
from h3quant.h3 import layouts

LAYOUTS = layouts.names()
SHARDS = 2
E4M3_MAX = 448.0
_TO_DIFFUSERS = (  # ComfyUI prefix -> diffusers prefix (first match), then infixes
    ("video_patch_proj.", "proj_in."), ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."), ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."), ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.video_out.", "proj_out."), ("final_layer.audio_out.", "audio_proj_out."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."), ("blocks.", "transformer_blocks."),
)
_INFIXES = ((".attn.out_proj.", ".attn.to_out.0."), (".attn.q_norm.", ".attn.norm_q."),
            (".attn.k_norm.", ".attn.norm_k."), (".mlp.fc1.", ".ff.net.0.proj."),
            (".mlp.fc2.", ".ff.net.2."))
_FP8_LINEAR = re.compile(r"(?:^|[._])blocks\.\d+\.(?:attn\.(?:qkv_proj|out_proj|to_[qkv]|to_out\.0)"
                         r"|mlp\.fc[12]|ff\.net\.(?:0\.proj|2))\.weight$")


def _diffusers_name(name: str) -> str:
    for a, b in _TO_DIFFUSERS:
        if name.startswith(a):
            name = b + name[len(a):]
            break
    for a, b in _INFIXES:
        name = name.replace(a, b)
    return name


def _comfy(name: str, x: torch.Tensor, head_dim: int):
    yield name, x


def _official(name: str, x: torch.Tensor, head_dim: int):
    if name.endswith(".attn.qkv_proj.weight"):
        heads = x.shape[0] // (3 * head_dim)
        yield name, x.reshape(3, heads, head_dim, -1).transpose(0, 1).reshape(x.shape)
    else:
        yield name, x


def _diffusers(name: str, x: torch.Tensor, head_dim: int):
    if name.endswith(".attn.qkv_proj.weight"):
        stem = _diffusers_name(name[: -len(".attn.qkv_proj.weight")])
        for part, rows in zip("qkv", x.chunk(3, dim=0)):
            yield f"{stem}.attn.to_{part}.weight", rows
    elif name.endswith(".mlp.fc1.weight"):
        gate, value = x.chunk(2, dim=0)
        yield _diffusers_name(name), torch.cat([value, gate])
    else:
        yield _diffusers_name(name), x


# One writer per source layout of the registry (the inverse of its mapping onto ComfyUI's names).
_WRITERS = {layouts.Comfy.name: _comfy, layouts.Official.name: _official,
            layouts.Diffusers.name: _diffusers}
if set(_WRITERS) != set(LAYOUTS):
    raise ImportError("every source layout needs a synth writer")


def _tensors_of(name: str, x: torch.Tensor, layout: str, head_dim: int):
    """(name, tensor) pairs of one ComfyUI tensor in ``layout``."""
    yield from _WRITERS[layout](name, x, head_dim)


def _fp8(name: str, x: torch.Tensor):
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not _FP8_LINEAR.search(name):
        yield name, x
        return
    w = x.float()
    scale = (w.abs().amax() / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
    yield name, (w / scale).to(torch.float8_e4m3fn)
    yield name[: -len(".weight")] + ".scale_weight", scale


def _marker() -> torch.Tensor:
    """ComfyUI's scaled-fp8 marker as its own writer stores it: an empty fp8 tensor."""
    return torch.empty(0, dtype=torch.float8_e4m3fn)


def _converted(ckpt: Checkpoint, name: str, layout: str, fp8: bool, head_dim: int):
    if name == SCALED_FP8_MARKER:
        yield name, _marker()
        return
    for n, x in _tensors_of(name, ckpt.read(name), layout, head_dim):
        yield from (_fp8(n, x.contiguous()) if fp8 else [(n, x.contiguous())])


def write_layout(comfy: Path, out: Path, layout: str, *, fp8: bool = False) -> int:
    """Write ``comfy`` (a ComfyUI single file) to ``out`` in ``layout``; returns the bytes."""
    if layout not in LAYOUTS:
        raise UnsupportedError(f"unknown naming {layout!r} (known: {', '.join(LAYOUTS)})")
    with Checkpoint(comfy) as ckpt:
        head_dim = next(t.shape[0] for n, t in ckpt.tensors.items()
                        if n.endswith("blocks.0.attn.q_norm.weight"))
        plan: dict[str, list[Entry]] = {}
        for name in sorted(ckpt.tensors):  # header pass: shapes only, on meta tensors
            info = ckpt.tensors[name]
            meta = torch.empty(info.shape, dtype=to_torch(info.dtype), device="meta")
            plan[name] = [Entry(n, e.dtype, e.shape) for n, e in
                          ((n, entry_for(n, t)) for n, t in _meta_pairs(name, meta, layout,
                                                                        fp8, head_dim))]
        if fp8:
            plan[SCALED_FP8_MARKER] = [entry_for(SCALED_FP8_MARKER, _marker())]
        metadata = dict(ckpt.metadata)
        if layouts.get(layout).shard_stem is None:  # a single file
            layout_ = plan_layout([e for es in plan.values() for e in es], metadata)
            return _write(ckpt, out, layout_, list(plan), plan, layout, fp8, head_dim)
        out.mkdir(exist_ok=True)
        stem = layouts.get(layout).shard_stem
        names = list(plan)
        parts = [names[i::SHARDS] for i in range(SHARDS)]
        weight_map, total = {}, 0
        for i, part in enumerate(parts, 1):
            fname = f"{stem}-{i:05d}-of-{SHARDS:05d}.safetensors"
            lay = plan_layout([e for n in part for e in plan[n]], metadata)
            total += _write(ckpt, out / fname, lay, part, plan, layout, fp8, head_dim)
            weight_map.update({e.name: fname for n in part for e in plan[n]})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        cls = layouts.get(layout).config_class
        (out / "config.json").write_text(json.dumps({"_class_name": cls}) + "\n")
        return total


def _meta_pairs(name, meta, layout, fp8, head_dim):
    for n, x in _tensors_of(name, meta, layout, head_dim):
        if fp8 and x.dtype == torch.bfloat16 and x.dim() == 2 and _FP8_LINEAR.search(n):
            yield n, torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="meta")
            yield n[: -len(".weight")] + ".scale_weight", torch.empty(1, device="meta")
        else:
            yield n, x


def _write(ckpt, path, layout_, sources, plan, layout, fp8, head_dim) -> int:
    """Each entry in layout order, from its source tensor (recomputed per entry, so memory holds
    one source tensor and its outputs, whatever the order)."""
    source_of = {e.name: n for n in sources for e in plan[n]}
    with StreamingWriter(path, layout_) as w:
        for entry in layout_.order:
            outs = dict(_converted(ckpt, source_of[entry.name], layout, fp8, head_dim))
            w.write_tensor(entry.name, outs.pop(entry.name))
            del outs
    return layout_.file_bytes
