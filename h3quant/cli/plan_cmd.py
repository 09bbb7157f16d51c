"""``h3quant plan IN``: per-block sensitivity, a planner that writes a recipe, the frontier."""

from __future__ import annotations

import json
import math
import sys

import click

from h3quant.cli.inputs_option import inputs_option, one_input
from h3quant.cli.common import CHECKPOINT, SEED, emit_json, finite_float, format_table, guard, \
    handle_errors, log, mmap_option, progress_enabled
from h3quant import sizes
from h3quant.sizes import mb_number, size_text
from h3quant.limits import MAX_JSON_BYTES, MAX_SQNR_DB

def parse_size(text: str) -> int:
    """``800MB``, ``1.5GB``, ``2GiB``, ``123456`` -> bytes; click's error for anything else."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _size(ctx, param, value):
    return None if value is None else parse_size(value)


def _formats(ctx, param, value):
    from h3quant.pipelines.plan.sensitivity import PlanError, parse_candidates

    try:
        return parse_candidates(value)
    except PlanError as exc:
        raise click.BadParameter(exc.reason) from None


def _targets(ctx, param, value):
    if value is None:
        return None
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of dB values") \
            from None
    if not out or not all(math.isfinite(v) for v in out):
        raise click.BadParameter("give finite dB values, e.g. 25,30,35")
    wild = [v for v in out if abs(v) > MAX_SQNR_DB]
    if wild:
        raise click.BadParameter(f"{wild[0]:g} dB is outside -{MAX_SQNR_DB:g} .. "
                                 f"{MAX_SQNR_DB:g}")
    return out


def _db(v: float) -> str:
    return "exact" if v == math.inf else f"{v:.2f}"


def render_sensitivity(sens) -> str:
    table = sens.table()
    fmts = sens.formats
    rows = []
    for unit, by in table.items():
        rows.append([unit] + [f"{_db(by[f].sqnr_db['video'])} / {_db(by[f].sqnr_db['audio'])}"
                              for f in fmts])
    per = sum(sens.seconds_per_block) / max(1, len(sens.seconds_per_block))
    head = (f"whole-model output SQNR (video / audio, dB) with only that "
            f"{'linear' if sens.per_layer else 'block'} quantized, the rest float; "
            f"{sens.blocks} blocks, {len(sens.units)} measurements in {sens.seconds:.1f} s "
            f"({per:.2f} s per block)")
    return head + "\n" + format_table(["unit"] + fmts, rows)


def render_prediction(pred, exact_bytes: int, input_bytes: int) -> str:
    counts = ", ".join(f"{n} x {f}" for f, n in sorted(pred.counts().items()))
    return (f"planned: {counts}\npredicted whole-model SQNR: video {_db(pred.sqnr_db['video'])} "
            f"dB, audio {_db(pred.sqnr_db['audio'])} dB\n"
            f"planned size: {exact_bytes:,} bytes ({size_text(exact_bytes)}; "
            f"input {size_text(input_bytes)})")


def render_frontier(points) -> str:
    rows = []
    for p in points:
        rows.append([p.name, mb_number(p.predicted_bytes),
                     "-" if p.measured_bytes is None else mb_number(p.measured_bytes),
                     _db(p.predicted_min),
                     "-" if p.measured_min is None else _db(p.measured_min),
                     "-" if p.measured_min is None or not math.isfinite(p.predicted_min)
                     else f"{p.measured_min - p.predicted_min:+.2f}",
                     ", ".join(f"{n} {f}" for f, n in sorted(p.formats.items()))])
    return ("size against whole-model SQNR (worse of video and audio)\n"
            + format_table(["file", "MB predicted", "MB measured", "dB predicted",
                            "dB measured", "error", "formats"], rows, {1, 2, 3, 4, 5}))


def _why_not_a_pass(exc: BaseException) -> str:
    """What is wrong with a --from file, in words (never a bare exception text)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"it is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(exc, OSError):
        return f"cannot read it ({exc.strerror or exc})"
    if isinstance(exc, KeyError):
        return (f"it lacks the field \"{exc.args[0]}\" (save a pass with "
                "'h3quant plan IN --json > pass.json')")
    return "its fields do not have the types a saved pass holds"


@click.command("plan", epilog="""\b
Examples:
  h3quant plan h3_bf16.safetensors                      # sensitivity table
  h3quant plan h3_bf16.safetensors --per-layer --json > sens.json
  h3quant plan h3_bf16.safetensors --target-sqnr 30 --out recipe.json
  h3quant plan h3_bf16.safetensors --from sens.json --max-size 1.2GB --out recipe.json
  h3quant convert h3_bf16.safetensors planned.safetensors --recipe recipe.json
  h3quant verify planned.safetensors --model --reference h3_bf16.safetensors
  h3quant plan h3_bf16.safetensors --from sens.json --frontier --plot frontier.png
  h3quant plan h3_bf16.safetensors --calibration h3.stats --target-sqnr 30 --out recipe.json
  h3quant convert h3_bf16.safetensors planned.safetensors --recipe recipe.json \\
      --calibration h3.stats
  h3quant plan h3_bf16.safetensors --calibration h3.stats --smooth auto --per-layer \\
      --formats int4-convrot,w4a8,nvfp4,int8-convrot --max-size 11GB --out recipe.json
  h3quant convert h3_bf16.safetensors planned.safetensors --recipe recipe.json \\
      --calibration h3.stats --smooth auto
  h3quant plan h3_bf16.safetensors --device ampere --vram 8GB         # an RTX 3070
  h3quant plan h3_bf16.safetensors --device ada --vram 16GB --resolution 1280x720 --frames 121""")
@click.argument("src", metavar="IN", type=CHECKPOINT)
@click.option("--formats", "cands", default="int8-convrot,w4a8", show_default=True,
              callback=_formats,
              help="Candidate formats (comma-separated convert --to choices with options, e.g. "
                   "int8-convrot:g=64 or int8-convrot,w4a8,nvfp4,int4-convrot); float is always "
                   "the unquantized choice. With --calibration the formats that calibrate are "
                   "measured calibrated and labelled FORMAT+gptq.")
@click.option("--calibration", "calibration", type=click.Path(dir_okay=False, path_type=str),
              default=None, metavar="STATS",
              help="Statistics from 'h3quant capture IN': measure each candidate that "
                   "calibrates with the codes 'convert --calibration STATS' writes (labelled "
                   "e.g. w4a8+gptq); the recipe reproduces them when converted with the same "
                   "--calibration STATS.")
@click.option("--smooth", type=click.Choice(["auto", "off"]), default="off", show_default=True,
              help="With --calibration: measure each candidate smoothed as 'convert --calibration "
                   "STATS --smooth auto' writes it (labelled e.g. w4a8+gptq+smooth); convert the "
                   "recipe with the same two options.")
@click.option("--per-layer", is_flag=True,
              help="Measure (and plan) each linear alone instead of each block.")
@click.option("--from", "from_json", type=click.Path(dir_okay=False, path_type=str),
              help="Reuse a sensitivity pass saved with --json instead of measuring again "
                   "(a regular file of at most 16 MiB, refused unless it was measured on IN).")
@click.option("--target-sqnr", type=finite_float(-MAX_SQNR_DB, MAX_SQNR_DB), default=None,
              metavar="DB",
              help="Plan the smallest file whose predicted whole-model SQNR (worse of video and "
                   f"audio) is at least DB (-{MAX_SQNR_DB:g} .. {MAX_SQNR_DB:g}).")
@click.option("--margin", type=click.FloatRange(0, 20), default=1.0, show_default=True,
              metavar="DB",
              help="--target-sqnr (and --frontier's targets): plan for DB more than the "
                   "target, for the additive model's error (docs/plan.md).")
@click.option("--max-size", default=None, callback=_size, metavar="SIZE",
              help="Plan the best predicted quality within a file size of SIZE (e.g. 800MB, "
                   "1.5GB, 2GiB); for a card's memory use --device with --vram.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=str),
              help="Write the planned recipe (JSON, for convert --recipe) to this file.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--frontier", is_flag=True,
              help="Size against SQNR for all-bf16, each all-FORMAT file and planner files at "
                   "several targets, predicted and measured (converts and verifies each: slow).")
@click.option("--targets", default=None, callback=_targets, metavar="DB,DB,..",
              help="--frontier: the planner targets (default: 3 between the uniform files).")
@click.option("--no-measure", is_flag=True,
              help="--frontier: predictions only (no conversion, no verify).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="--frontier: draw it to this PNG (needs matplotlib: pip install "
                   "'h3quant[plot]').")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the inputs.")
@click.option("--frames", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="Video latent frames of the seeded input.")
@inputs_option(dest="inputs_file",
               help="Measure on the latents in this safetensors file (video, audio, text, "
                    "optional sigma: the file verify --model --inputs takes) instead of seeded "
                    "ones (a folder or glob, quoted or not, must name exactly one file).")
@click.option("--device", "device_class", default=None, metavar="CLASS",
              help="Plan for a machine instead: a device class (turing, ampere, ada, hopper, "
                   "blackwell-dc, blackwell, apple, ascend, cpu) with --vram; prints the VRAM "
                   "estimate and the format to make (headers only, nothing measured or written).")
@click.option("--vram", default=None, callback=_size, metavar="SIZE",
              help="With --device: the card's memory, e.g. 8GB, 16GiB.")
@click.option("--resolution", default=None, metavar="WxH",
              help="With --device: the video size (default 1344x768).")
@click.option("--text-encoder", "text_encoder", default=None, metavar="FILE",
              help="With --device: count this text encoder's weights too.")
@click.option("--vae", default=None, metavar="FILE", help="With --device: count this VAE too.")
@click.option("--any-format", is_flag=True,
              help="With --device: also offer formats the device only dequantizes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or notes on stderr.")
@mmap_option
@handle_errors
def command(src, cands, calibration, smooth, per_layer, from_json, target_sqnr, margin, max_size,
            out_path, overwrite, frontier, targets, no_measure, plot, seed, frames, inputs_file,
            device_class, vram, resolution, text_encoder, vae, any_format, as_json, quiet,
            no_mmap):
    """Measure how much each block of float H3 checkpoint IN matters, and plan a mixed file.

    The sensitivity pass runs the whole model streamed (fp32, CPU) on seeded inputs and, for
    each block (--per-layer: each linear) and candidate format, the whole-model output SQNR
    with only that unit quantized. With --target-sqnr or --max-size the planner chooses a
    format per unit, predicts the result (noise energies of the units add, docs/plan.md) and
    writes the recipe with --out. Exit status: 0 ok, 2 usage or I/O error (nothing written).
    """
    import os

    if device_class is not None or vram is not None:
        from h3quant.cli.plan_machine import run_machine_plan

        return run_machine_plan(click.get_current_context(), src, device_class, vram,
                                resolution, frames, text_encoder, vae, any_format, as_json,
                                not no_mmap)
    if frames > 64:
        raise click.BadParameter("at most 64 latent frames for the measurement (more with "
                                 "--device: the video's frames)", param_hint="--frames")
    from h3quant.errors import H3QuantError
    from h3quant.pipelines.plan.frontier import frontier as run_frontier
    from h3quant.pipelines.plan.planner import Model, reasons
    from h3quant.pipelines.plan.sensitivity import Sensitivity, is_smoothed, measure

    inputs_file = one_input(inputs_file)
    if target_sqnr is not None and max_size is not None:
        raise click.UsageError("give --target-sqnr or --max-size, not both")
    if target_sqnr is not None and not math.isfinite(target_sqnr):
        raise click.BadParameter("must be finite", param_hint="--target-sqnr")
    if out_path and target_sqnr is None and max_size is None:
        raise click.UsageError("--out writes a planned recipe: give --target-sqnr or --max-size")
    if smooth == "auto" and not calibration:
        raise click.UsageError("--smooth auto needs --calibration STATS (the factors are chosen "
                               "from its statistics)")
    if (targets or no_measure or plot) and not frontier:
        raise click.UsageError("--targets, --no-measure and --plot apply to --frontier")
    from h3quant.formats.container.iofiles import CommandFiles

    # every file this run reads and writes, checked before anything is read
    files = CommandFiles("plan")
    files.checkpoint(src)
    files.read(from_json, "saved pass (--from)")
    files.read(inputs_file, "--inputs file")
    files.read(calibration, "statistics (--calibration)")
    files.write(out_path, "recipe")
    files.write(plot, "plot")
    files.check(overwrite=overwrite)
    given_inputs = None
    if inputs_file is not None:
        from click.core import ParameterSource

        from h3quant.pipelines.verify.model import ModelInputs

        ctx = click.get_current_context()
        wrong = [f"--{n}" for n in ("seed", "frames", "from")
                 if ctx.get_parameter_source(n if n != "from" else "from_json")
                 is ParameterSource.COMMANDLINE]
        if wrong:
            raise click.UsageError(f"{', '.join(wrong)} cannot be used with --inputs "
                                   "(the file gives the latents; a saved pass records its own)")
        given_inputs = ModelInputs.from_file(inputs_file)
    # --out and --plot follow the output rules, are checked before the long work and are
    # written together at the end (both or neither)
    pending: list[tuple[str, bytes, str]] = []
    if files.outputs:
        from h3quant.formats.container.checkpoint import Checkpoint

        with Checkpoint(src, mmap=not no_mmap) as ck:
            for shard in [sf.path for sf in ck.files] + ([ck.index_path] if ck.index_path
                                                          else []):
                files.read(shard, "input shard")

        def check_all():
            outs = files.transaction(overwrite=overwrite)
            for o in files.outputs:
                outs.check(o.path, what=o.what)

        guard("checking the outputs", check_all)
    plt = None
    if plot:
        from h3quant.cli.verify_view import require_matplotlib

        plt = require_matplotlib()
    if from_json:
        from h3quant.formats.container.smallfile import read_bounded
        from h3quant.pipelines.fingerprint import check, checkpoint_fingerprint

        raw = read_bounded(from_json, MAX_JSON_BYTES, "saved pass (--from)")
        try:
            loaded = json.loads(raw.decode("utf-8"))
            sens = Sensitivity.from_dict(loaded.get("sensitivity", loaded)
                                         if isinstance(loaded, dict) else loaded)
        except H3QuantError as exc:
            raise H3QuantError(f"--from {from_json}: {exc.reason}") from None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise H3QuantError(f"--from {from_json}: not a sensitivity pass saved by "
                               f"'h3quant plan --json': {_why_not_a_pass(exc)}") from None
        # a pass belongs to the checkpoint it was measured on: refused for any other file
        actual = {"checkpoint": guard("reading IN", checkpoint_fingerprint, src,
                                      mmap=not no_mmap)}
        if calibration:  # the pass must have been measured with these statistics
            from h3quant.pipelines.plan.sensitivity import statistics_identity

            actual["statistics"] = guard("reading --calibration", statistics_identity,
                                         calibration)
        check(sens.measured_on, actual, what=f"--from {from_json}")
        if smooth == "auto" and not any(map(is_smoothed, sens.formats)):
            raise click.UsageError(f"--smooth auto: --from {from_json} was measured without "
                                   "smoothing; measure again with --smooth auto")
    else:
        from tqdm import tqdm

        from h3quant.pipelines.verify.model import ModelInputs

        bar = tqdm(total=None, unit="block", desc="sensitivity", file=sys.stderr, leave=False,
                   disable=quiet or not progress_enabled())

        def on_block(done, total):
            bar.total = total
            bar.update(1)

        try:
            sens = guard("measuring the sensitivity", measure, src, formats=cands,
                         per_layer=per_layer, inputs=given_inputs or ModelInputs(frames=frames, seed=seed),
                         mmap=not no_mmap, on_block=on_block, calibration=calibration,
                         smooth=smooth == "auto")
        finally:
            bar.close()
    from h3quant.pipelines.plan.frontier import source_bytes

    model = Model(sens, source_bytes(src))
    doc: dict = {"sensitivity": sens.to_dict()}
    text = [render_sensitivity(sens)]
    if target_sqnr is not None or max_size is not None:
        from h3quant.pipelines.plan.fit import plan_file

        fitted = guard("planning", plan_file, src, model, max_size=max_size,
                       target_sqnr=None if target_sqnr is None else target_sqnr + margin,
                       calibration=calibration)
        pred, rules, exact = fitted.prediction, fitted.rules, fitted.file_bytes
        calibrated, smoothed = fitted.calibrated, fitted.smooth
        doc["plan"] = {**pred.to_dict(), "planned_bytes": exact,
                       "rules": [r.to_dict() for r in rules]}
        text.append(render_prediction(pred, exact, model.input_bytes))
        stats_name = (sens.measured_on.get("statistics") or {}).get("file", "STATS")
        # over the budget = over it with the header this plan's file has
        why = reasons(model, pred, max_size=fitted.tensor_budget(max_size),
                      target_sqnr=target_sqnr)
        doc["plan"]["reasons"] = why
        flags = f" --calibration {calibration or stats_name}" + (
            " --smooth auto" if smoothed == "auto" else "")
        if calibrated:
            doc["plan"]["calibration"] = {"formats": calibrated, "statistics": stats_name}
            text.append(f"calibrated: {', '.join(calibrated)} (convert with{flags} to write "
                        "these codes)")
        if out_path:
            from h3quant.pipelines.convert.recipe import recipe_data
            from h3quant.pipelines.metrics import json_safe

            notes = {"planned_by": "h3quant plan", "source": os.path.basename(src),
                     "target_sqnr_db": target_sqnr, "margin_db": margin,
                     "max_size_bytes": max_size,
                     "predicted": json_safe({**pred.to_dict(), "planned_bytes": exact}),
                     "inputs": sens.inputs, "per_layer": sens.per_layer,
                     "reasons": json_safe(why)}
            if calibrated:
                notes["calibration"] = {
                    "formats": calibrated, "statistics": stats_name,
                    "note": f"measured with calibrated codes: convert with{flags} to write "
                            "them"}
            data = json.dumps(recipe_data(rules, **notes), indent=2) + "\n"
            pending.append((out_path, data.encode(), "recipe"))
            done_note = (f"wrote {out_path} ({len(rules)} rule(s)); apply it with: h3quant "
                         f"convert {src} OUT --recipe {out_path}"
                         + (flags if calibrated else ""))
    if frontier:
        if not quiet and not no_measure:
            log("frontier: converting and verifying each point (slow)")
        points = guard("drawing the frontier", run_frontier, src, model, targets,
                       margin=margin, measure=not no_measure, mmap=not no_mmap,
                       calibration=calibration)
        doc["frontier"] = [p.to_dict() for p in points]
        text.append(render_frontier(points))
        if plt is not None:
            from h3quant.pipelines.plan.frontier import plot as draw

            pending.append((plot, draw(points, plt), "plot"))
    if pending:
        guard("writing the outputs", _write_all, pending, files, overwrite)
        if not quiet:
            for p, _, what in pending:
                log(done_note if what == "recipe" else f"wrote {p}")
    if as_json:
        from h3quant.pipelines.metrics import json_safe

        emit_json(json_safe(doc))
    else:
        click.echo("\n\n".join(text))


def _write_all(pending, files, overwrite) -> None:
    """Write every (path, bytes, what) in one transaction: all appear, or none."""
    from h3quant.formats.container.atomic import write_file

    with files.transaction(overwrite=overwrite) as outs:
        for path, data, what in pending:
            write_file(outs.add(path, what=what), data)
