"""``h3quant verify``: run the quantized blocks on a device and compare them with a float reference."""

from __future__ import annotations

import sys

import click

from h3quant.cli import verify_view as view
from h3quant.cli.inputs_option import inputs_option, one_input
from h3quant.cli.common import (
    CHECKPOINT,
    given_options,
    inputs_from_file,
    progress_enabled,
    EXIT_FINDINGS,
    EXIT_OK,
    MAX_BLOCKS,
    MAX_TOKENS,
    SEED,
    MAX_AUDIO_FRAMES,
    MAX_MODEL_ROWS,
    device_callback,
    emit_json,
    finite_float,
    guard,
    handle_errors,
    log,
    mmap_option,
)
from h3quant.device_kinds import device_help

_HELP = """Verify CKPT numerically: each quantized linear of the first N blocks, and each whole block,
against a float reference, plus reference-free checks of the stored codes; or (--model) the
whole H3 forward.

\b
The reference is --reference (the BF16 checkpoint the file was made from) or, without it, the
file's own weights dequantized to fp32 (then the layer/block checks test the runtime, and the
data checks test the stored codes).

\b
Checks (default thresholds):
  layer       relative L2 error <= 0.05 (int8_tensorwise), <= 0.12 (asym_w4a8_int8),
              fc2 also through the fused SwiGLU entry point
  block       SQNR of the residual update >= 20 dB (int8), >= 8 dB (with W4A8 layers)
  scales      every scale finite and > 0
  row-range   int8: max|q| == 127 in every non-zero row (126-128 when made in bf16
              arithmetic, as comfy-kitchen does from bf16 weights); W4A8: peak in [96, 127]
              (at most 1 % of rows may miss)
  saturation  at most 1 % of codes at |q| >= 127 beyond each row's peak
  magnitude   dequantized row-norm RMS within 3x of the float linears of the same role
              (e.g. token_refiner) in the file; catches scales off by a constant
              (a heuristic: --magnitude-factor 0 turns it off)
A wrong Hadamard or permuted rows are only caught with --reference. With --reference the layer
and block limits above give way to a fresh plain encode of the reference in the file's own
formats, checked the same way: a layer may exceed its relative error, a block fall below its
SQNR, by 5 dB (12 dB with W4A8 layers); the fixed limits stay where a format cannot be
re-encoded, and with --no-expected. int8 and fp8 layers of a bf16 or f16 reference are also
encoded as comfy-kitchen encodes them in that dtype, and each figure is held to the lower of
the two encodes' (the note and --json say which encode set each limit). The encode is a temporary file
the size of the reference in TMPDIR (its size is printed first; memory holds about one layer;
one encode at a time), removed when done.

\b
Exit status: 0 all checks pass, 1 a check failed, 2 usage or I/O error.

\b
Examples:
  h3quant verify h3_int8.safetensors
  h3quant verify h3_int8.safetensors --reference h3_bf16.safetensors --blocks 4
  h3quant verify model.safetensors.index.json --device npu --no-mmap --json
  h3quant verify h3_nvfp4.safetensors --reference h3_bf16.safetensors --no-expected

\b
The whole model (--model): the real H3 forward of CKPT (every block, streamed: one block in
memory at a time) against the reference forward on the same seeded inputs (--frames --height
--width --audio-frames --text-tokens --sigma --seed), interleaved block by block. Reports the
video and audio output SQNR / relative error and the drift (hidden-state SQNR after each block).
With --reference, video, audio and the last hidden state are held to a fresh plain encode of
the reference in the file's own formats, run the same way on the same inputs, less a margin
of 5 dB (12 dB with W4A8): the error the format is expected to have on this model (a
calibrated file may beat it). Where nothing can be re-encoded, or without --reference, they must reach SQNR >= 20 dB
(int8) or >= 8 dB (any W4A8 layer). The packed sequence, text + 2 x audio frames + frames x ceil(H/2) x ceil(W/2)
rows, is at most {rows} (checked before any work). --depth N runs the first N blocks only
(the final layer is skipped); --plot FILE.png draws the drift (needs matplotlib: pip install 'h3quant[plot]').
  h3quant verify h3_int8.safetensors --reference h3_bf16.safetensors --model
  h3quant verify h3_int8.safetensors --model --depth 8 --plot drift.png --json
A bank of output heads (few-step checkpoints) is checked on every step of a schedule: --steps N
(the sampler's simple schedule with shift 12) or --sigmas 1,0.9,...,0 (the sampler's own).
  h3quant verify h3_fewstep_int8.safetensors --model --steps 8

\b
Tensor parallel (--tp N): spawns N ranks (or joins torchrun's group) and checks that the
sharded blocks compute what one device computes: bit-identical with --tp-scale shared (the
default: one activation scale all_reduced over the ranks), within rel L2 0.05 with per-rank.
With --reference the same blocks are then also verified against the float file on one device
(the verdicts of verify --reference); both must pass.
Only --tp makes a run tensor-parallel: RANK, WORLD_SIZE, MASTER_PORT... left in the environment
are ignored without it. With --tp, torchrun's group is joined when its variables and
TORCHELASTIC_RUN_ID are set (--tp must equal WORLD_SIZE; a malformed variable is a usage
error); otherwise N local ranks are spawned. Every rendezvous and collective ends within
--tp-timeout seconds (exit 2, naming the rank and the operation), whatever listens on MASTER_PORT.
  h3quant verify h3_int8.safetensors --tp 2
  h3quant verify h3_int8.safetensors --tp 2 --reference h3_bf16.safetensors --blocks 1
  h3quant verify h3_int8.safetensors --tp 4 --tp-scale per-rank --blocks 1
  h3quant verify h3_int8.safetensors --tp 4 --model      # the whole forward, sharded blocks
  torchrun --nproc-per-node 4 -m h3quant verify h3_int8.safetensors --tp 4 --tp-timeout 60
"""


_MODEL_ONLY = ("frames", "height", "width", "audio_frames", "text_tokens", "depth", "plot",
               "overwrite", "steps", "sigmas", "inputs_file")
_BLOCK_ONLY = ("blocks", "tokens", "magnitude_factor")


@click.command("verify", help=_HELP.replace("{rows}", f"{MAX_MODEL_ROWS:,}"),
               context_settings={"max_content_width": 100})
@click.argument("ckpt", type=CHECKPOINT)
@click.option("--reference", type=CHECKPOINT, default=None,
              help="Float (BF16) checkpoint the file was quantized from.")
@click.option("--device", default="auto", show_default=True, callback=device_callback(True, parsed=True),
              help=f"{device_help()} (checked before any work).")
@click.option("--model", "whole_model", is_flag=True,
              help="Run the whole H3 forward (all blocks, streamed) instead of per-block checks.")
@click.option("--blocks", type=click.IntRange(1, MAX_BLOCKS), default=2, show_default=True,
              help="Per-block mode: verify the first N blocks.")
@click.option("--tokens", type=click.IntRange(4, MAX_TOKENS), default=64, show_default=True,
              help=f"Per-block mode: activation rows per layer and packed rows per block input "
                   f"(4 .. {MAX_TOKENS}).")
@click.option("--frames", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="--model: latent video frames T.")
@click.option("--height", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="--model: latent height H (odd sizes are padded to the 2x2 patch).")
@click.option("--width", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="--model: latent width W.")
@click.option("--audio-frames", type=click.IntRange(1, MAX_AUDIO_FRAMES), default=32,
              show_default=True,
              help=f"--model: audio latent frames Ta (stereo: 2 x Ta rows; at most "
                   f"{MAX_AUDIO_FRAMES}).")
@click.option("--text-tokens", type=click.IntRange(1, MAX_TOKENS), default=64, show_default=True,
              help="--model: text tokens L.")
@click.option("--sigma", type=click.FloatRange(min=0, max=1, min_open=True), default=0.6,
              show_default=True, help="The sampler's video sigma (timesteps of adaLN).")
@click.option("--steps", type=click.IntRange(1, 1000), default=None,
              help="--model: check every step of the sampler's N-step schedule (shift 12); "
                   "needed by a bank of output heads.")
@click.option("--sigmas", default=None, metavar="S0,S1,...",
              help="--model: check every step of this schedule (comma-separated sigmas, "
                   "non-increasing, in [0, 1]; the last one ends the schedule).")
@click.option("--depth", type=click.IntRange(1, MAX_BLOCKS), default=None,
              help="--model: run only the first N blocks (the final layer is then skipped).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="--model: draw the drift against depth to this PNG (needs matplotlib).")
@click.option("--overwrite", is_flag=True,
              help="--plot: replace an existing plot file (the plot is never an input, a link "
                   "or a non-regular file, nor inside an input directory).")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the random inputs (0 .. 2^32-1).")
@inputs_option(dest="inputs_file",
               help="--model: read the latents from this safetensors file (video [1,C,T,H,W], "
                    "audio [1,C,2,Ta], text [1,L,D], optional sigma; docs/verify.md) instead "
                    "of drawing them from --seed; the same file plan --inputs takes (a folder "
                    "or glob, quoted or not, must name exactly one file).")
@click.option("--magnitude-factor", type=finite_float(0, 1e6), default=3.0, show_default=True,
              help="Allowed factor between quantized and float sibling magnitudes (0: skip the "
                   "magnitude check).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("--expected/--no-expected", default=True, show_default=True,
              help="With --reference: hold layers, blocks and outputs to a fresh plain encode "
                   "of the reference in the file's own formats (checked the same way, a 5 dB "
                   "margin); --no-expected uses the fixed per-format limits.")
@click.option("--tp", type=click.IntRange(min=1), default=None,
              help="Tensor parallel over N ranks (spawned here, or torchrun's group when "
                   "launched by torchrun): compare the sharded blocks with one device.")
@click.option("--tp-scale", type=click.Choice(["shared", "per-rank"]), default="shared",
              show_default=True, help="Row-parallel activation scale: one all_reduced scale "
                                      "(bit-identical) or each rank its own.")
@click.option("--tp-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, help="Seconds the rendezvous or any collective may wait before "
                                      "the run fails (exit 2).")
@mmap_option
@click.option("--quiet", "-q", is_flag=True, help="No progress bar on stderr.")
@handle_errors
def command(ckpt, reference, device, whole_model, blocks, tokens, frames, height, width,
            audio_frames, text_tokens, sigma, steps, sigmas, depth, plot, overwrite, seed,
            inputs_file, magnitude_factor,
            as_json, expected, tp, tp_scale, tp_timeout, no_mmap, quiet=False):
    ctx = click.get_current_context()
    inputs_file = one_input(inputs_file)
    parallel = tp is not None  # never the environment alone (docs/verify.md)
    schedule = _schedule(steps, sigmas, ctx)
    if whole_model:
        wrong = given_options(ctx, _BLOCK_ONLY + (("plot", "overwrite", "steps", "sigmas") if parallel
                                           else ("tp_scale", "tp_timeout")))
        mode = "--model --tp" if parallel else "--model"
    else:
        wrong = given_options(ctx, _MODEL_ONLY + (() if parallel else ("tp_scale", "tp_timeout")))
        mode = "the per-block mode (add --model)" + ("" if parallel else " without --tp")
    if wrong:
        raise click.UsageError(f"{', '.join(wrong)} cannot be used with {mode}")
    # every file this run reads and writes, checked before anything is read
    _files(ckpt, reference, inputs_file, plot).check(overwrite=overwrite)
    given_inputs = inputs_from_file(ctx, inputs_file, sigma) if whole_model else None
    if parallel:
        from h3quant.pipelines.verify.model import ModelInputs

        inputs = given_inputs or ModelInputs(frames, height, width, audio_frames, text_tokens,
                                             sigma, seed) if whole_model else None
        _tensor_parallel(ckpt, reference, device, blocks, tokens, seed, as_json, tp, tp_scale,
                         tp_timeout, no_mmap, inputs, depth, sigma, magnitude_factor)
        return
    if whole_model:
        _run_model(ckpt, reference, device, frames, height, width, audio_frames, text_tokens,
                   sigma, depth, plot, seed, as_json, no_mmap, overwrite, schedule,
                   given_inputs, quiet, expected)
    from h3quant.pipelines.verify.blocks import Thresholds, verify_checkpoint

    log(f"verifying {ckpt} ({blocks} blocks, {tokens} tokens, device {device})")
    th = Thresholds(magnitude_factor=magnitude_factor)
    from tqdm import tqdm

    bar = tqdm(total=None, unit="block", desc="blocks", file=sys.stderr, leave=False,
               disable=not progress_enabled(quiet))

    def on_block(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    try:
        res = guard("verifying", verify_checkpoint, ckpt, reference=reference, device=device,
                    blocks=blocks, tokens=tokens, seed=seed, sigma=sigma, mmap=not no_mmap,
                    thresholds=th, on_block=on_block, expected=expected, log=log)
    finally:
        bar.close()
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(view.render_blocks(res))
    sys.exit(EXIT_OK if res.passed else EXIT_FINDINGS)


def _files(ckpt, reference, inputs_file, plot):
    """The files of a verify run: CKPT, --reference and --inputs read; --plot written."""
    from h3quant.formats.container.iofiles import CommandFiles

    files = CommandFiles("verify")
    files.checkpoint(ckpt, "checkpoint")
    files.checkpoint(reference, "reference")
    files.read(inputs_file, "--inputs file")
    files.write(plot, "plot")
    return files


def _schedule(steps, sigmas, ctx):
    """The schedule of --steps / --sigmas (None without them); a bad one is a usage error."""
    if steps is None and sigmas is None:
        return None
    if steps is not None and sigmas is not None:
        raise click.UsageError("--steps and --sigmas cannot be used together")
    if given_options(ctx, ("sigma",)):
        raise click.UsageError("--sigma cannot be used with --steps / --sigmas (each step has "
                               "its own sigma)")
    from h3quant.errors import VerifyError
    from h3quant.runtime.model.schedule import check_schedule, shifted_schedule

    try:
        if steps is not None:
            return shifted_schedule(steps)
        values = [v.strip() for v in sigmas.split(",") if v.strip()]
        out = check_schedule(values)
    except VerifyError as e:
        raise click.BadParameter(str(e), param_hint="--sigmas") from None
    if not out[0] > 0:
        raise click.BadParameter("the first sigma must be > 0", param_hint="--sigmas")
    return out


def _run_model(ckpt, reference, device, frames, height, width, audio_frames, text_tokens, sigma,
               depth, plot, seed, as_json, no_mmap, overwrite=False, schedule=None,
               given_inputs=None, quiet=False, expected=True):
    from tqdm import tqdm

    from h3quant.pipelines.verify.model import ModelInputs, verify_model

    plot_inputs = ()
    if plot:  # the plot is an output like any other: checked before the long run
        from h3quant.formats.container.atomic import check_output

        plot_inputs = _files(ckpt, reference, given_inputs.file if given_inputs else None,
                             plot).input_paths
        check_output(plot, directory=False, overwrite=overwrite, inputs=plot_inputs,
                     what="plot")
        view.require_matplotlib()
    inputs = given_inputs or ModelInputs(frames, height, width, audio_frames, text_tokens,
                                         sigma, seed)
    log(f"verifying the whole model {ckpt} against "
        f"{reference or 'its own weights in float math (no --reference)'} on device {device}")
    bar = tqdm(total=None, unit="block", desc="blocks", file=sys.stderr, leave=False,
               disable=not progress_enabled(quiet))

    def on_block(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    try:
        res = guard("verifying the model", verify_model, ckpt, reference=reference,
                    device=device, inputs=inputs, depth=depth, mmap=not no_mmap,
                    on_block=on_block, sigmas=schedule, expected=expected, log=log)
    finally:
        bar.close()
    if plot:
        view.plot(res, plot, overwrite=overwrite, inputs=plot_inputs)
        log(f"wrote {plot}")
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(view.render_model(res))
    sys.exit(EXIT_OK if res.passed else EXIT_FINDINGS)


def _tensor_parallel(ckpt, reference, device, blocks, tokens, seed, as_json, tp, tp_scale,
                     tp_timeout, no_mmap, model_inputs=None, depth=None, sigma=0.6,
                     magnitude_factor=3.0):
    from h3quant.pipelines.verify.blocks import Thresholds
    from h3quant.pipelines.verify.tp import verify_tp

    what = "the whole model" if model_inputs else f"{blocks} blocks"
    log(f"verifying {ckpt} with tp={tp} ({tp_scale} scale, {what}, device {device})")
    res = guard("running tensor parallel", verify_tp, ckpt, tp=tp, scale_mode=tp_scale,
                device=device, blocks=blocks, tokens=tokens, seed=seed, mmap=not no_mmap,
                timeout_s=tp_timeout, sigma=sigma, model=model_inputs is not None,
                model_inputs=model_inputs, depth=depth, reference=reference,
                thresholds=Thresholds(magnitude_factor=magnitude_factor))
    if res is None:  # a torchrun rank other than 0: rank 0 reports
        sys.exit(EXIT_OK)
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(view.render_tp(res))
    sys.exit(EXIT_OK if res.passed else EXIT_FINDINGS)
