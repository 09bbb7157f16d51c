"""``h3quant capture``: per-linear input statistics for calibrated conversion."""

from __future__ import annotations

from pathlib import Path

import click

from h3quant.cli.common import (
    CHECKPOINT_PATH,
    device_callback,
    emit_json,
    finite_float,
    format_table,
    guard,
    handle_errors,
    log,
    memory_budget_option,
    progress_enabled,
)
from h3quant.cli.inputs_option import inputs_option
from h3quant.device_kinds import device_help


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("ckpt", type=CHECKPOINT_PATH)
@inputs_option(required=True,
               help="Inputs files (video, audio and text latents, optional sigma: the file "
                    "'verify --model --inputs' reads, as the recorder writes one per sampler "
                    "step): files, folders (their *.safetensors) or globs, quoted or not, "
                    "several after one --inputs or --inputs repeated. Each holds its hidden "
                    "state during the run.")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="The statistics file to write (safetensors; each H stored as its upper "
                   "triangle, about 2 x K^2 bytes per linear: ~0.63 GB per block at H3's full "
                   "width).")
@click.option("--sigma", type=finite_float(1e-6, 1.0), default=0.6, show_default=True,
              help="Noise level of inputs files that record none.")
@click.option("--device", default="cpu", show_default=True, callback=device_callback(True),
              help=f"Where the forward and the accumulation run: {device_help(auto=False)}. "
                   "The forward and H = X^T X run in float32 there (TF32 off); the channel "
                   "magnitudes' sum in float64 (on the host for a device without float64, "
                   "MPS).")
@click.option("--through", type=CHECKPOINT_PATH, default=None,
              help="Run the forward through this checkpoint instead (an uncalibrated "
                   "conversion of CKPT, on the device's runtime path): each block is then "
                   "measured on the inputs the quantized blocks before it produce. The "
                   "statistics still belong to CKPT.")
@click.option("--group-size", type=click.IntRange(4, 1024), default=256, show_default=True,
              help="ConvRot group size of the predicted gain's rotated basis.")
@click.option("--no-predict", is_flag=True,
              help="Skip the predicted gains (a Cholesky factorisation per layer and basis).")
@memory_budget_option
@click.option("--tp", type=click.IntRange(1, 64), default=None,
              help="Tensor parallel: run the forward over N spawned CPU ranks (gloo), each "
                   "holding its shard of every block (as 'verify --tp'); rank 0 writes the "
                   "statistics, equal to the single-process capture's up to float32 rounding. "
                   "A float CKPT only; not with --through or another --device. "
                   "--memory-budget is each rank's.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no summary table.")
@handle_errors
def command(ckpt, inputs, out, sigma, device, through, group_size, no_predict, memory_budget,
            tp, overwrite, as_json, quiet):
    """Measure CKPT's DiT block linears on your own inputs, for 'convert --calibration'.

    Runs the H3 forward block by block over every --inputs file and records, for each block
    linear (qkv_proj, out_proj, fc1, fc2), the second moment H = X^T X of its inputs over
    every row it saw (text, audio and video; every step) and each input channel's mean
    magnitude. Memory holds one block's statistics plus the inputs' hidden states (within
    --memory-budget, the rest on disk beside OUT in OUT.h3q-spill); the file
    is written one block at a time and appears only when complete. It records CKPT's header
    checksum: convert refuses it for any other checkpoint.

    Prints, per layer, the predicted gain of calibrated rounding over rounding to nearest
    (from the statistics alone; 'plain' for int8, 'convrotG' for int8-convrot and w4a8), so
    you can see whether the conversion is worth its time. Layers that saw fewer rows than
    their input width are warned about: convert rounds them to nearest.

    Exit status: 0 statistics written, 2 usage or I/O error (nothing written).

    \b
    Examples:
      h3quant capture h3.safetensors --inputs steps/*.safetensors --out h3.stats
      h3quant capture h3.safetensors --inputs a.safetensors b.safetensors \\
          --out h3.stats --device cuda
      h3quant capture h3.safetensors --inputs "steps/*.safetensors" --out h3.stats
      h3quant capture h3.safetensors --inputs steps --out h3.stats   # a folder
      h3quant capture h3.safetensors --through h3_w4a8.safetensors \\
          --inputs steps/*.safetensors --out h3_seq.stats     # quantized-block inputs
      h3quant capture h3.safetensors --inputs steps --out h3.stats --tp 2   # 2 CPU ranks
      h3quant convert h3.safetensors h3_w4a8.safetensors --to w4a8 --calibration h3.stats
    """
    from h3quant.pipelines.capture import capture_statistics

    result = guard("capture", capture_statistics, ckpt, list(inputs), out, sigma=sigma,
                   device=device, through=through, overwrite=overwrite,
                   predict=not no_predict, group_size=group_size, memory_budget=memory_budget,
                   progress=progress_enabled(quiet), log=log, tp=tp)
    for w in result.warnings:
        log(f"warning: {w}")
    if as_json:
        emit_json(result.to_dict())
        return
    if quiet:
        return
    log(f"wrote {out}: {len(result.widths)} linears of {result.blocks} blocks, "
        f"{len(result.inputs)} input(s), {result.rows:,} rows per linear, "
        f"{result.seconds:.1f} s")
    if result.gains:
        bases = sorted({b for g in result.gains.values() for b in g})
        rows = [[k, result.widths[k]] + [f"{g.get(b, float('nan')):.1f}" for b in bases]
                for k, g in result.gains.items()]
        click.echo("predicted gain of calibrated rounding over round-to-nearest (dB, output "
                   "error, from the statistics alone):")
        click.echo(format_table(["layer", "K"] + bases, rows, right=set(range(1, 2 + len(bases)))))
