"""Shared helpers of the fp8 / mxfp8 format tests: a tiny synthetic H3, kitchen's quantizers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.forge import cli, save
from h3quant.formats.markers import marker_tensor
from h3quant.h3.topology import is_h3_block_linear
from h3quant.synth import synth_checkpoint
from h3quant.synth.layouts import write_layout

LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def tiny(path: Path, seed: int = 0) -> Path:
    synth_checkpoint(path, preset="tiny", blocks=1, seed=seed, workers=1)
    return path


def fp8_release(root: Path, seed: int) -> dict[str, Path]:
    """A tiny synthetic H3 (``bf16``, every block) and the same weights in ComfyUI's fp8_scaled
    form (``fp8``: ``synth.layouts.write_layout``), both in ``root``."""
    bf16, fp8 = root / "h3.safetensors", root / "fp8.safetensors"
    synth_checkpoint(bf16, preset="tiny", seed=seed)
    write_layout(bf16, fp8, "comfy", fp8=True)
    return {"bf16": bf16, "fp8": fp8}


def block_linears(tensors: dict) -> list[str]:
    """Layer names of the DiT block linears (what --to quantizes by default)."""
    return sorted(n[: -len(".weight")] for n in tensors
                  if n.endswith(".weight") and is_h3_block_linear(n[: -len(".weight")])
                  and tensors[n].dim() == 2)


def kitchen_state(w: torch.Tensor, layout: str, name: str, **kw) -> dict[str, torch.Tensor]:
    """comfy-kitchen's own serialization of ``w`` quantized by ``layout`` (eager backend)."""
    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor

    with ck.registry.use_backend("eager"):
        qt = QuantizedTensor.from_float(w, layout, **kw)
    return {k: v.contiguous() for k, v in qt.state_dict(f"{name}.weight").items()}


def kitchen_file(src: Path, out: Path, layout: str, fmt: str, **kw) -> dict[str, dict]:
    """``src`` with every block linear replaced by kitchen's quantization of its bf16 weight and
    ComfyUI's marker (tensor and header metadata), as ComfyUI's own state_dict writes it."""
    t = load_file(src)
    layers = {}
    for name in block_linears(t):
        t.update(kitchen_state(t.pop(f"{name}.weight"), layout, name, **kw))
        layers[name] = {"format": fmt}
        t[f"{name}.comfy_quant"] = marker_tensor(layers[name])
    save(out, t)
    return layers


def convert(src: Path, out: Path, target: str, *extra) -> None:
    r = cli("convert", src, out, "--to", target, *extra)
    assert r.exit_code == 0, r.output


def validate_json(path: Path, *extra) -> tuple[int, dict]:
    r = cli("validate", path, "--json", *extra)
    return r.exit_code, json.loads(r.stdout)


def verify_json(path: Path, *extra) -> tuple[int, dict]:
    r = cli("verify", path, "--json", "--blocks", "1", "--tokens", "32", *extra)
    return r.exit_code, json.loads(r.stdout)
