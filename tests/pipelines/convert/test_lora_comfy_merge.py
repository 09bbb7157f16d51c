"""A baked LoRA equals what ComfyUI computes when it applies the LoRA at load time, bit for bit.

ComfyUI (comfy/weight_adapter/lora.py ``LoRAAdapter.calculate_weight``, applied by
comfy/model_patcher.py to an fp32 copy of the weight, then rounded to the stored dtype):

    lora_diff = torch.mm(up.float(), down.float())
    weight += (strength * (alpha / rank)) * lora_diff      # per adapter, in order
    stored = weight.to(stored_dtype)

computed here independently, on whole matrices (the product is not split in row blocks)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from h3quant.pipelines.convert import lora as lm

ROWS, K = 2 * lm.MERGE_ROWS + 72, 512  # three row blocks, the last one partial
LAYER = "blocks.0.mlp.fc2"
BASE = {f"{LAYER}.weight": (ROWS, K)}


def _lora(path, rank: int, alpha: float | None, seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    down = (torch.randn(rank, K, generator=g) * scale).bfloat16()
    up = (torch.randn(ROWS, rank, generator=g) * scale).bfloat16()
    t = {f"diffusion_model.{LAYER}.lora_down.weight": down,
         f"diffusion_model.{LAYER}.lora_up.weight": up}
    if alpha is not None:
        t[f"diffusion_model.{LAYER}.alpha"] = torch.tensor(alpha)
    save_file(t, str(path))
    return up, down


def _comfy(weight, adapters):
    w = weight.to(torch.float32, copy=True)
    for up, down, strength, alpha, rank in adapters:
        a = alpha / rank if alpha is not None else 1.0
        lora_diff = torch.mm(up.to(torch.float32), down.to(torch.float32))
        w += ((strength * a) * lora_diff).type(w.dtype)
    return w


def test_bf16_bake_equals_comfyui_runtime_merge(tmp_path):
    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(ROWS, K, generator=g) * 0.05).bfloat16()
    up1, down1 = _lora(tmp_path / "a.safetensors", 32, 16.0, 1, 0.3)
    up2, down2 = _lora(tmp_path / "b.safetensors", 8, None, 2, 0.2)
    specs = [f"{tmp_path / 'a.safetensors'}:0.8", f"{tmp_path / 'b.safetensors'}:-1.3"]
    got = lm.load(specs, BASE).merged(LAYER, weight, torch.bfloat16)
    exact = _comfy(weight, [(up1, down1, 0.8, 16.0, 32), (up2, down2, -1.3, None, 8)])
    want = exact.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the float64 merge (one rounding of the exact sum) differs from ComfyUI somewhere here
    f64 = weight.double() + 0.8 * 0.5 * (up1.double() @ down1.double()) \
        - 1.3 * (up2.double() @ down2.double())
    assert not torch.equal(f64.to(torch.bfloat16), want)


def test_fp32_bake_equals_comfyui_runtime_merge(tmp_path):
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(ROWS, K, generator=g) * 0.05
    up, down = _lora(tmp_path / "a.safetensors", 16, 4.0, 3, 0.5)
    got = lm.load([f"{tmp_path / 'a.safetensors'}:1.7"], BASE).merged(LAYER, weight,
                                                                       torch.float32)
    want = _comfy(weight, [(up, down, 1.7, 4.0, 16)])
    assert torch.equal(got, want)
