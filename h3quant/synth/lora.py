"""Small synthetic LoRA files for an H3 config, in each key style (for demos and tests).

Styles: ``comfyui`` (``diffusion_model.`` prefix, ``lora_down``/``lora_up``, ``alpha``),
``kohya`` (``lora_unet_blocks_0_attn_qkv_proj``), ``diffusers`` (``transformer.`` prefix,
split ``attn.to_q/to_k/to_v``, ``ff.net.0.proj`` in ``[value; gate]`` order, PEFT
``lora_A``/``lora_B``, no alpha). Deterministic for a seed.
"""

from __future__ import annotations

import torch

from h3quant.h3.lora import STYLES
from h3quant.h3.topology import H3Config

LORA_STYLES = STYLES


def lora_tensors(cfg: H3Config, style: str, rank: int = 4, scale: float = 0.01,
                 seed: int = 0, blocks: int | None = None) -> dict[str, torch.Tensor]:
    if style not in LORA_STYLES:
        raise ValueError(f"unknown LoRA style {style!r} (choose from {', '.join(LORA_STYLES)})")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def pair(stem: str, down_sfx: str, up_sfx: str, n: int, k: int, alpha: float | None):
        out[stem + down_sfx] = (torch.randn(rank, k, generator=g) * scale).bfloat16()
        out[stem + up_sfx] = (torch.randn(n, rank, generator=g) * scale).bfloat16()
        if alpha is not None:
            out[stem + ".alpha"] = torch.tensor(alpha, dtype=torch.float32)

    h, a = cfg.hidden, cfg.attn_width
    for i in range(min(blocks or cfg.blocks, cfg.blocks)):
        if style == "diffusers":
            pre = f"transformer.blocks.{i}."
            for p in "qkv":
                pair(pre + f"attn.to_{p}", ".lora_A.weight", ".lora_B.weight", a, h, None)
            pair(pre + "attn.to_out.0", ".lora_A.weight", ".lora_B.weight", h, a, None)
            pair(pre + "ff.net.0.proj", ".lora_A.weight", ".lora_B.weight", 2 * cfg.ffn, h, None)
            pair(pre + "ff.net.2", ".lora_A.weight", ".lora_B.weight", h, cfg.ffn, None)
            continue
        for sub in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            n, k = cfg.linear_shape(sub)
            name = f"blocks.{i}.{sub}"
            stem = ("lora_unet_" + name.replace(".", "_")) if style == "kohya" \
                else "diffusion_model." + name
            pair(stem, ".lora_down.weight", ".lora_up.weight", n, k, float(rank) / 2)
    return out


def write_lora(path: str, cfg: H3Config, style: str, *, overwrite: bool = True, **kw) -> str:
    """Write the LoRA to ``path`` atomically (the output rules of every h3quant command:
    never a non-regular file, an existing file only with ``overwrite``)."""
    from h3quant.formats.container.atomic import Outputs
    from h3quant.formats.container.writer import StreamingWriter, entry_for, plan_layout

    tensors = lora_tensors(cfg, style, **kw)
    layout = plan_layout([entry_for(n, t) for n, t in tensors.items()],
                         {"h3quant.synth_lora": style})
    with Outputs(overwrite=overwrite) as outs:
        staged = outs.add(path, what="LoRA")
        with StreamingWriter(staged, layout) as w:
            for entry in layout.order:
                w.write_tensor(entry.name, tensors[entry.name])
    return path
