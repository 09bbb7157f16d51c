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
    given_options,
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
              help="Tensor parallel over N ranks (as 'verify --tp'): spawned here, one per "
                   "device of --device's kind (cpu: gloo, cuda: nccl, npu: hccl), or "
                   "torchrun's group when launched by torchrun; each holds its shard of every "
                   "block, rank 0 writes the statistics (equal to the single-process capture's "
                   "on that device up to float32 rounding). A float CKPT only; not with "
                   "--through. --memory-budget is each rank's.")
@click.option("--tp-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, help="--tp: seconds the rendezvous or any collective may wait "
                                      "before the run fails (exit 2).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no summary table.")
@handle_errors
def command(ckpt, inputs, out, sigma, device, through, group_size, no_predict, memory_budget,
            tp, tp_timeout, overwrite, as_json, quiet):
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
      h3quant capture h3.safetensors --inputs steps --out h3.stats --device cuda --tp 2
      torchrun --nproc-per-node 4 -m h3quant capture h3.safetensors --inputs steps \\
          --out h3.stats --device cuda --tp 4 --tp-timeout 300
      h3quant convert h3.safetensors h3_w4a8.safetensors --to w4a8 --calibration h3.stats

    \b
    Tensor parallel (--tp N), for a device that cannot hold a block's activations at your
    inputs' resolution: the ranks run the forward, each on its own device (cuda:0 .. cuda:N-1,
    npu:0 .. npu:N-1, or N CPU processes), float32 as the single-process capture, and rank 0
    accumulates the statistics on its device. N local ranks are spawned unless torchrun
    started this process (its variables and TORCHELASTIC_RUN_ID set; --tp must equal
    WORLD_SIZE; every rank then takes LOCAL_RANK's device and only rank 0 writes OUT). --device
    mps has no collectives; fewer devices than N, or a torch without the backend (nccl, hccl
    from torch_npu), is refused before any work (exit 2).
    """
    from h3quant.pipelines.capture import capture_statistics

    if tp is None and given_options(click.get_current_context(), ("tp_timeout",)):
        raise click.UsageError("--tp-timeout needs --tp")
    result = guard("capture", capture_statistics, ckpt, list(inputs), out, sigma=sigma,
                   device=device, through=through, overwrite=overwrite,
                   predict=not no_predict, group_size=group_size, memory_budget=memory_budget,
                   progress=progress_enabled(quiet), log=log, tp=tp, tp_timeout_s=tp_timeout)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
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
