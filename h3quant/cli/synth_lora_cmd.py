"""``h3quant synth-lora``: a small synthetic LoRA file for a synthetic H3, in one key style."""

from __future__ import annotations

import click

from h3quant.cli.common import guard, handle_errors
from h3quant.h3.lora import STYLE_HELP, STYLES


@click.command("synth-lora", epilog="""\b
Examples:
  h3quant synth-lora lora.safetensors                       # ComfyUI style, tiny preset
  h3quant synth-lora kohya.safetensors --style kohya --rank 8
  h3quant synth-lora peft.safetensors --style diffusers --blocks 1
  h3quant inspect lora.safetensors""")
@click.argument("out", type=click.Path(dir_okay=False, path_type=str))
@click.option("--style", type=click.Choice(STYLES), default="comfyui", show_default=True,
              help="Key style: " + "; ".join(f"{k} = {v}" for k, v in STYLE_HELP.items()) + ".")
@click.option("--preset", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True,
              help="H3 dimensions the adapters fit.")
@click.option("--blocks", type=click.IntRange(1, 1000), default=None,
              help="Adapters on the first N DiT blocks (default: every block of the preset).")
@click.option("--rank", type=click.IntRange(1, 1024), default=4, show_default=True)
@click.option("--scale", type=click.FloatRange(0, 100), default=0.01, show_default=True,
              help="Standard deviation of the A and B entries.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@handle_errors
def command(out, style, preset, blocks, rank, scale, seed, overwrite) -> None:
    """Write a deterministic synthetic LoRA (BF16 A/B pairs) on the DiT block linears.

    The same options and seed give the same bytes; OUT appears only when complete. Exit
    status: 0 written, 2 usage or I/O error.
    """
    from h3quant.h3.topology import config_for
    from h3quant.synth.lora import write_lora

    cfg = config_for(preset, blocks=blocks)
    guard("writing a LoRA", write_lora, out, cfg, style, rank=rank, scale=scale, seed=seed,
          overwrite=overwrite)
    click.echo(f"wrote {out} ({style} style, rank {rank}, {cfg.blocks} block(s))")
