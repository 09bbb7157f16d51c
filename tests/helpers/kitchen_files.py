"""Files written by comfy-kitchen's own quantizers (and hand-built AWQ files), for the format tests.

Everything here is computed with comfy-kitchen and safetensors directly, never with h3quant's
codecs: the tests compare h3quant against these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def marker_tensor(obj: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def block_linear_names(tensors: dict) -> list[str]:
    return sorted(k[:-len(".weight")] for k in tensors
                  if k.endswith(".weight") and k.startswith("blocks.")
                  and any(k[:-len(".weight")].endswith(lin) for lin in BLOCK_LINEARS))


def kitchen_quantize(w: torch.Tensor, layout: str, **kw) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` comfy-kitchen's layout writes for ``w`` (its state_dict)."""
    from comfy_kitchen.tensor import QuantizedTensor

    sd = QuantizedTensor.from_float(w, layout, **kw).state_dict("x.weight")
    return {k[len("x."):]: v.contiguous() for k, v in sd.items()}


def kitchen_file(src: Path, out: Path, layout: str, marker: dict, **kw) -> Path:
    """``src`` with every block linear replaced by kitchen's quantization of it and ComfyUI's
    per-layer ``.comfy_quant`` marker tensor."""
    t = read_all(src)
    for name in block_linear_names(t):
        w = t.pop(name + ".weight")
        for suffix, v in kitchen_quantize(w, layout, **kw).items():
            t[f"{name}.{suffix}"] = v
        t[name + ".comfy_quant"] = marker_tensor(marker)
    save_file(t, str(out))
    return out


def awq_quantize(w: torch.Tensor, group: int = 64, dtype=torch.bfloat16):
    """A plain min/max asymmetric 4-bit quantization in comfy-kitchen's AWQ W4A16 layout:
    (packed int8 [N, K/2] with the even column low, scales [K/G, N], zeros [K/G, N]), with
    ``W ~ (q - 8) * scale + zero``. Written here from the layout's documented formula."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + 8 * scale  # (q - 8) * scale + zero = lo at q = 0
    q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    q = q.reshape(n, k)
    packed = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), scale.t().to(dtype).contiguous(), zero.t().to(dtype).contiguous()


def awq_file(src: Path, out: Path, group: int = 64, dtype=torch.bfloat16) -> Path:
    t = read_all(src)
    for name in block_linear_names(t):
        q, s, z = awq_quantize(t.pop(name + ".weight"), group, dtype)
        t[name + ".weight"], t[name + ".weight_scale"], t[name + ".weight_zeros"] = q, s, z
        t[name + ".comfy_quant"] = marker_tensor({"format": "awq_w4a16", "group_size": group})
    save_file(t, str(out))
    return out
