"""``h3quant synth``: write a synthetic H3-shaped checkpoint (no real weights needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from h3quant.cli.common import MAX_BLOCKS, SEED, handle_errors, log
from h3quant.sizes import size_text
from h3quant.h3 import layouts

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar only for outputs at least this big


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True,
              help="Widths: 'tiny' (hidden 512, fast tests) or 'full' (the real H3 dims, "
                   "hidden 5376: ~0.77 GB per DiT block plus ~1.6 GB of token refiner and "
                   "other tensors; 50 blocks make ~40 GB).")
@click.option("--blocks", type=click.IntRange(1, MAX_BLOCKS), default=None,
              help="Number of DiT blocks (default: 2 for tiny, 50 for full).")
@click.option("--form", type=click.Choice(["pruned", "full"]), default="pruned", show_default=True,
              help="'pruned': adaln_t_table [1025, 8] (the released form); 'full': "
                   "time_embedder.proj_in/proj_out.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Random seed (0 .. 2^32-1); the same options and seed give byte-identical files.")
@click.option("--naming", type=click.Choice(layouts.names()), default=layouts.TARGET,
              show_default=True, help="Layout written: " + layouts.help_text())
@click.option("--dtype", "wdtype", type=click.Choice(["bf16", "fp8"]), default="bf16",
              show_default=True,
              help="fp8: the DiT and refiner block linears as float8_e4m3fn codes with a "
                   "per-tensor F32 scale_weight (ComfyUI's scaled fp8).")
@click.option("--head-bank", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Stack N output heads in final_layer.video_out / audio_out (N x 96 / N x 32 "
                   "rows), as few-step checkpoints do; 1 writes the plain heads.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")
@handle_errors
def command(out: Path, preset: str, blocks: int | None, form: str, seed: int, naming: str,
            wdtype: str, head_bank: int, overwrite: bool, quiet: bool) -> None:
    """Write a synthetic, unquantized H3-shaped checkpoint to OUT.

    The file has the real H3 DiT tensor names, dtypes and shapes (FORMATS.md 5) with seeded
    random data: Gaussian linears with a few large-outlier input channels, norms near 1, small
    biases. Data is generated and streamed one chunk at a time, so memory stays small.
    OUT appears only when complete. Exit status: 0 written, 2 usage or I/O error.

    \b
    Examples:
      h3quant synth h3_tiny.safetensors
      h3quant synth h3_tiny_full.safetensors --form full --seed 7
      h3quant synth /tmp/h3_2blk.safetensors --preset full --blocks 2   # ~3.1 GB
      h3quant synth h3_official/ --naming official      # shards + index, as released
      h3quant synth h3_diffusers/ --naming diffusers --dtype fp8
      h3quant synth h3_fewstep.safetensors --head-bank 4                # a 4-head bank
    """
    from h3quant.formats.container.atomic import Outputs
    from h3quant.h3.topology import BLOCK_LINEARS, config_for
    from h3quant.synth import synth_checkpoint

    cfg = config_for(preset, blocks=blocks, form=form)
    # Rough size for the progress decision: 2 bytes per element of the big 16-bit tensors.
    per_block = 2 * sum(n * k for n, k in (cfg.linear_shape(s) for s in BLOCK_LINEARS))
    approx = per_block * (cfg.blocks + cfg.refiner_blocks)
    relayout = naming != layouts.TARGET or wdtype != "bf16"
    with Outputs(overwrite=overwrite, log=log) as outs:
        # checked before any work; appears only when complete
        staged = outs.add(out, directory=naming != layouts.TARGET)
        plain = staged.parent / (staged.name + ".comfy.safetensors") if relayout else staged
        result = synth_checkpoint(plain, preset=preset, blocks=blocks, form=form, seed=seed,
                                  head_bank=head_bank,
                                  progress=not quiet and approx >= PROGRESS_MIN_BYTES
                                  and sys.stderr.isatty())
        if relayout:
            from h3quant.synth.layouts import write_layout

            nbytes = write_layout(plain, staged, naming, fp8=wdtype == "fp8")
            plain.unlink()
            result = type(result)(out, result.config, nbytes, result.tensors)
    if not quiet:
        c = result.config
        log(f"wrote {out} ({size_text(result.nbytes)}, {result.tensors} tensors): H3 "
            f"preset={preset} form={c.form} blocks={c.blocks} refiner_blocks={c.refiner_blocks} "
            f"hidden={c.hidden} heads={c.heads}x{c.head_dim} ffn={c.ffn} t={c.t_dim} seed={seed}"
            + (f" head_bank={head_bank}" if head_bank > 1 else ""))
