"""Synthetic H3-named checkpoints and the file helpers the convert, loader and verify tests share:
a miniature H3 state dict, writing / reading / hashing files, shards, rewrites with edits, and a
block-linear quantizer built on the codecs."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.writer import save_tensors
from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor

_LINEAR_RE = re.compile(r"^(?:.*\.)?blocks\.\d+\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$")

H3_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def small_h3(blocks: int = 2, hidden: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    """A miniature H3-named checkpoint (bf16 block linears, refiner, condition_proj, norms)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t: dict[str, torch.Tensor] = {}
    for i in range(blocks):
        p = f"blocks.{i}."
        t[p + "attn.qkv_proj.weight"] = w(3 * hidden, hidden)
        t[p + "attn.out_proj.weight"] = w(hidden, hidden)
        t[p + "mlp.fc1.weight"] = w(4 * hidden, hidden)
        t[p + "mlp.fc2.weight"] = w(hidden, 2 * hidden)
        t[p + "norm1.weight"] = w(hidden)
        t[p + "norm2.weight"] = w(hidden)
        t[p + "attn.q_norm.weight"] = w(128)
        t[p + "adaln_proj.linear.weight"] = w(6 * hidden, 8)
        t[p + "adaln_proj.linear.bias"] = w(6 * hidden)
    t["token_refiner.blocks.0.attn.qkv_proj.weight"] = w(3 * hidden, hidden)
    t["token_refiner.blocks.0.mlp.fc1.weight"] = w(4 * hidden, hidden)
    t["condition_proj.weight"] = w(hidden, 64)
    t["condition_proj.bias"] = w(hidden)
    t["video_patch_proj.weight"] = w(hidden, 96, dtype=torch.float32)
    t["video_patch_proj.bias"] = w(hidden, dtype=torch.float32)
    t["final_layer.video_out.weight"] = w(96, hidden, dtype=torch.float32)
    t["rope.inv_freq"] = torch.arange(16, dtype=torch.float32)
    t["adaln_t_table"] = w(1025, 8, dtype=torch.float32)
    return t


def write(path: Path, tensors, metadata=None) -> Path:
    save_tensors(path, tensors, metadata)
    return path


def sha(path: Path) -> str:
    path = Path(path)
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            if path.is_dir():
                h.update(str(f.relative_to(path)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def block_linears(blocks: int = 2) -> list[str]:
    return [f"blocks.{i}.{s}" for i in range(blocks) for s in H3_LINEARS]


def read_all(path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, bytes]]:
    with Checkpoint(path) as ck:
        tensors = {n: ck.read(n).clone() for n in ck.tensors}
        raw = {n: bytes(ck.read_bytes(n)) for n in ck.tensors}
        return tensors, dict(ck.metadata), raw


def make_sharded(d: Path, tensors: dict, parts: int = 2) -> Path:
    """``tensors`` split by name into ``parts`` shard files plus an index."""
    d.mkdir(parents=True)
    names = sorted(tensors)
    step = -(-len(names) // parts)
    weight_map, total = {}, 0
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i * step:(i + 1) * step]}
        layout = save_tensors(d / fname, chunk, {"shard": str(i)})
        total += layout.data_bytes
        weight_map.update(dict.fromkeys(chunk, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total, "note": "kept"}, "weight_map": weight_map}))
    return d


def resave(src: Path, dst: Path, *, metadata=None, edit=None) -> Path:
    """Copy ``src`` to ``dst`` after ``edit(tensors, metadata)``, with ``metadata`` replacing the
    metadata when given."""
    tensors, meta, _ = read_all(src)
    if edit:
        edit(tensors, meta)
    save_tensors(dst, tensors, meta if metadata is None else metadata)
    return dst


def read_tensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor (cloned) and the metadata of a checkpoint."""
    with Checkpoint(path) as ck:
        return {n: ck.read(n).clone() for n in ck.tensors}, dict(ck.metadata)


def quantize_file(src, dst, *, fmt: str | dict = "int8", header: bool = True,
                  tensor_markers: bool = True, mutate=None) -> Path:
    """Quantize the DiT block linears of ``src`` (token_refiner stays BF16) with the codecs.

    ``fmt``: "int8", "w4a8", or {block linear role: format} (others int8). ``mutate(layer,
    parts, w)`` may return altered tensors (to forge defects)."""
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.formats.int8.codec import int8_marker
    from h3quant.formats.w4a8.tensors import encode_w4a8
    from h3quant.formats.w4a8.codec import w4a8_marker

    tensors, meta = read_tensors(src)
    out, layers = {}, {}
    for name, t in tensors.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer is None or not _LINEAR_RE.match(layer) or "token_refiner" in layer:
            out[name] = t
            continue
        role = layer.split(".", 2)[-1]
        kind = fmt.get(role, "int8") if isinstance(fmt, dict) else fmt
        if kind == "int8":
            q, s = encode_int8(t, convrot=True, group_size=256, per_row=True, method="dense")
            parts, marker = {"weight": q, "weight_scale": s}, int8_marker(convrot=True, group_size=256)
        else:
            parts, marker = dict(encode_w4a8(t, codebook="frozen")), w4a8_marker()
        if mutate is not None:
            parts = mutate(layer, parts, t)
        out.update({f"{layer}.{k}": v for k, v in parts.items()})
        if tensor_markers:
            out[layer + ".comfy_quant"] = marker_tensor(marker)
        layers[layer] = marker
    if header:
        meta[HEADER_KEY] = header_metadata_value(layers)
    save_tensors(dst, out, meta)
    return Path(dst)


def rewrite(src, dst, fn) -> Path:
    """Copy ``src`` to ``dst`` after ``fn(tensors, metadata)`` edits the dicts in place."""
    tensors, meta = read_tensors(src)
    fn(tensors, meta)
    save_tensors(dst, tensors, meta)
    return Path(dst)


def set_header_layer(meta: dict, layer: str, fields: dict | None) -> None:
    obj = json.loads(meta[HEADER_KEY])
    if fields is None:
        obj["layers"].pop(layer, None)
    else:
        obj["layers"][layer] = fields
    meta[HEADER_KEY] = json.dumps(obj)
