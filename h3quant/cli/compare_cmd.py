"""``h3quant compare``: a quality card for several H3 files, side by side, on one device."""

from __future__ import annotations

import sys

import click

from h3quant.cli.inputs_option import inputs_option, one_input
from h3quant.cli.common import (
    CHECKPOINT,
    given_options,
    inputs_from_file,
    EXIT_FINDINGS,
    EXIT_OK,
    MAX_AUDIO_FRAMES,
    MAX_TOKENS,
    SEED,
    device_callback,
    emit_json,
    guard,
    handle_errors,
    log,
    mmap_option,
    progress_enabled,
)
from h3quant.device_kinds import device_help

_HELP = """Compare FILE... against a reference: which file is good? Prints a card: per file the
output SQNR of one forward (video and audio apart), the drift after every block, a sampling
run (the same initial noise through N flow-matching Euler steps; the final latent's SQNR /
PSNR against the reference's and the drift after every step), the size, bits per weight, the
mix of formats and the time per sampler step on --device.

\b
Every file runs the real H3 forward, streamed block by block, on the same inputs (seeded, or
--inputs FILE) as the reference, which runs once on the CPU in float32 and is reused for
every file. Without --reference the most precise file given (a float file, else the most bits
per weight) is the reference, and the card says so. Files: safetensors (single, sharded, any
format h3quant reads) and GGUF (read with the gguf package; pip install 'h3quant[gguf]').
Each file is judged against a fresh plain encode of the reference in the file's own formats
(the error the format is expected to have on this model): a block or output clearly worse
than it is flagged, naming the block and both figures. Files are ranked by the limiting
stream (the lower of the one-forward video / audio SQNR): files without a flag first, then
flagged files, then failing ones; differences the measured noise floor can explain are ties
(shown "="). SQNR and PSNR of a latent are not a perceptual metric and no VAE runs
(docs/compare.md).

Exit status: 0 card printed, 1 a file is flagged or breaks a rule (a finding), 2 usage or I/O
error (nothing written).

\b
Examples:
  h3quant compare h3_int8.safetensors h3_w4a8.safetensors h3-Q4_K.gguf --reference h3_bf16.safetensors
  h3quant compare h3_bf16.safetensors h3_int8.safetensors --steps 4 --json > card.json
  h3quant compare --reference h3_bf16.safetensors h3_*.safetensors --markdown card.md --plot card.png
  h3quant compare --reference ref.safetensors a.safetensors --sigmas 1,0.95,0.8,0 --device cuda
  h3quant compare --reference ref.safetensors a.safetensors --inputs latents.safetensors --steps 0
  h3quant compare --reference h3_bf16.safetensors h3_int8.safetensors --frontier --plot card.png
"""


@click.command("compare", help=_HELP, context_settings={"max_content_width": 100})
@click.argument("files", nargs=-1, required=True, type=CHECKPOINT)
@click.option("--reference", type=CHECKPOINT, default=None,
              help="The reference file (default: the most precise of FILE...).")
@click.option("--device", default="auto", show_default=True, callback=device_callback(True),
              help=f"Where the files run: {device_help()}.")
@click.option("--steps", type=click.IntRange(0, 1000), default=8, show_default=True,
              help="Sampler steps of the sampling run (the simple schedule, shift 12); 0: no "
                   "sampling run.")
@click.option("--sigmas", default=None, metavar="S0,S1,...",
              help="The sampling run's own schedule (comma-separated, non-increasing, in "
                   "[0, 1], every one but the last > 0), instead of --steps.")
@click.option("--frames", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="Latent video frames T.")
@click.option("--height", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Latent height H.")
@click.option("--width", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Latent width W.")
@click.option("--audio-frames", type=click.IntRange(1, MAX_AUDIO_FRAMES), default=32,
              show_default=True, help="Audio latent frames Ta.")
@click.option("--text-tokens", type=click.IntRange(1, MAX_TOKENS), default=64, show_default=True,
              help="Text tokens L.")
@click.option("--sigma", type=click.FloatRange(min=0, max=1, min_open=True), default=0.6,
              show_default=True, help="The sigma of the one-forward comparison (drift, outputs).")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the inputs and of the sampling run's noise.")
@inputs_option(dest="inputs_file",
               help="Read the latents (and the noise of the sampling run) from this "
                    "safetensors file, the one verify --model and plan --inputs take (a folder "
                    "or glob, quoted or not, must name exactly one file).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the card as JSON (one record per file, with the run's settings).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=str),
              default=None, metavar="FILE", help="Also write the card as markdown to FILE.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str),
              default=None, metavar="FILE",
              help="Also draw size against quality, the per-block and the per-step drift to a "
                   "PNG (needs matplotlib: pip install 'h3quant[plot]').")
@click.option("--frontier/--no-frontier", default=False, show_default=True,
              help="Also give the planner's predicted frontier over a float reference (size "
                   "against predicted output SQNR for per-block choices of int8-convrot, w4a8 "
                   "and float; in the card, --json, --markdown and --plot). Its cost: one "
                   "planner sensitivity pass, one streamed forward per candidate format per "
                   "block (as h3quant plan), on the CPU in float32; nothing is converted.")
@click.option("--expected/--no-expected", default=True, show_default=True,
              help="Judge each file against a fresh plain encode of the reference in its own "
                   "formats (one more forward per distinct mix of formats; two where int8 or "
                   "fp8 layers of a bf16 / f16 reference are also encoded as comfy-kitchen does "
                   "in that dtype, each figure then held to the lower); --no-expected "
                   "judges by the fixed per-format limits only.")
@click.option("--overwrite", is_flag=True, help="Replace existing --markdown / --plot files.")
@mmap_option
@handle_errors
def command(files, reference, device, steps, sigmas, frames, height, width, audio_frames,
            text_tokens, sigma, seed, inputs_file, as_json, markdown_path, plot_path, frontier,
            expected, overwrite, no_mmap):
    from h3quant.pipelines.compare.run import CompareOptions, compare_files
    from h3quant.pipelines.verify.model import ModelInputs

    ctx = click.get_current_context()
    inputs_file = one_input(inputs_file)
    if sigmas is not None and given_options(ctx, ("steps",)):
        raise click.UsageError("--steps and --sigmas cannot be used together")
    schedule = _schedule(steps, sigmas)
    inputs = inputs_from_file(ctx, inputs_file, sigma) or ModelInputs(
        frames, height, width, audio_frames, text_tokens, sigma, seed)
    every = [p for p in (reference, *files)]
    if len(set(every)) != len(every):
        raise click.UsageError("a file is named twice (FILE... and --reference must differ)")
    outputs = _check_outputs(every, inputs_file, markdown_path, plot_path, overwrite)
    opts = CompareOptions(inputs, None if schedule is None else tuple(schedule), device,
                          not no_mmap, frontier=frontier, expected=expected)
    res = guard("comparing", compare_files, files, reference=reference, options=opts,
                progress=_bar_factory(), log=log)
    _write(res, markdown_path, plot_path, overwrite, outputs)
    if as_json:
        emit_json(res.to_dict())
    else:
        from h3quant.cli.compare_view import render

        click.echo(render(res))
    if res.failed:  # validate --deep's data verdict, or non-finite outputs: never a success
        for c in res.failed:
            click.echo(f"h3quant: error: {c.facts.path}: {c.failures[0]}", err=True)
        sys.exit(EXIT_FINDINGS)
    flagged = [c for c in res.files if c.flags]
    if flagged:  # clearly worse than the format's own encode: a finding
        for c in flagged:
            click.echo(f"h3quant: error: {c.facts.path}: {c.flags[0]}", err=True)
        sys.exit(EXIT_FINDINGS)
    sys.exit(EXIT_OK)


def _schedule(steps, sigmas):
    from h3quant.errors import VerifyError
    from h3quant.runtime.model.schedule import check_schedule, shifted_schedule

    if sigmas is None:
        return None if steps == 0 else shifted_schedule(steps)
    try:
        out = check_schedule([v.strip() for v in sigmas.split(",") if v.strip()])
    except VerifyError as e:
        raise click.BadParameter(str(e), param_hint="--sigmas") from None
    if not all(s > 0 for s in out[:-1]):
        raise click.BadParameter("every sigma but the last must be > 0", param_hint="--sigmas")
    return out


def _check_outputs(inputs, inputs_file, markdown_path, plot_path, overwrite):
    """--markdown / --plot are outputs: never an input, never each other; checked before the
    long run."""
    from h3quant.formats.container.atomic import (
        check_output,
        check_outputs_distinct,
        checkpoint_inputs,
    )

    outs = [p for p in (markdown_path, plot_path) if p]
    if not outs:
        return ()
    ins = checkpoint_inputs(*inputs, inputs_file)
    check_outputs_distinct(outs)
    for p, what in ((markdown_path, "markdown"), (plot_path, "plot")):
        if p:
            check_output(p, directory=False, overwrite=overwrite, inputs=ins, what=what)
    if plot_path:
        from h3quant.cli.verify_view import require_matplotlib

        require_matplotlib()
    return ins


def _write(res, markdown_path, plot_path, overwrite, inputs) -> None:
    from h3quant.cli import compare_view as view
    from h3quant.formats.container.atomic import write_bytes

    if markdown_path:
        write_bytes(markdown_path, view.markdown(res).encode("utf-8"), overwrite=overwrite,
                    inputs=inputs, what="markdown")
        log(f"wrote {markdown_path}")
    if plot_path:
        write_bytes(plot_path, view.plot_png(res), overwrite=overwrite, inputs=inputs,
                    what="plot")
        log(f"wrote {plot_path}")


def _bar_factory():
    enabled = progress_enabled()

    def make(desc: str, total: int | None, unit: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                    disable=not enabled)

    return make
