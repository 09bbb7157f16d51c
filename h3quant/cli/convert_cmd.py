"""``h3quant convert IN OUT --to int8-convrot|int8|w4a8|fp8|fp8-e5m2|mxfp8|bf16``: streaming,
atomic conversion."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from h3quant.cli.inputs_option import inputs_option
from h3quant.cli.common import (
    CHECKPOINT,
    WORKERS,
    device_callback,
    emit_json,
    guard,
    handle_errors,
    log,
    memory_budget_option,
    mmap_option,
    progress_enabled,
)
from h3quant.device_kinds import device_help
from h3quant.errors import ConvertError
from h3quant.formats import registry
from h3quant.h3 import layouts
from h3quant.sizes import size_text

_TARGETS = tuple(registry.targets())


def default_output(src: str, target: str, layout: str | None = None) -> str:
    """OUT when none is given: beside IN, named after IN and the target. An input inside a
    Hugging Face cache (``models--ORG--NAME/snapshots/...``) is named after its repository and
    written to the current directory: outputs never go into the cache."""
    p = Path(src)
    if p.name.endswith(".index.json"):
        p = p.parent
    # a file's name without its extension (h3-Q4_K.gguf -> h3-Q4_K); a folder's name as it is
    stem, where = (p.name if p.is_dir() else p.stem), p.parent
    repo = next((a for a in p.absolute().parents if a.name.startswith("models--")), None)
    if repo is not None:
        rel = p.absolute().relative_to(repo).parts[2:]  # after snapshots/<rev>
        stem = "_".join([repo.name.split("--")[-1], *rel[:-1], *([stem] if rel else [])])
        where = Path(".")
    suffix = target + ("-npu" if layout == "npu" else "")
    return str(where / f"{stem or 'h3'}_{suffix}.safetensors")


def _group_size(ctx, param, value):
    from h3quant.convrot import is_valid_group_size

    if value is not None and (not is_valid_group_size(value) or value > 1024):
        raise click.BadParameter(f"{value} is not a power of 4 in 4..1024 (4, 16, 64, 256, 1024)")
    return value


@click.command("convert")
@click.argument("src", metavar="IN", type=CHECKPOINT)
@click.argument("dst", metavar="[OUT]", required=False, type=click.Path(path_type=str))
@click.option("--to", "target", type=click.Choice(_TARGETS), default="int8-convrot",
              show_default=True,
              help="Target format of the selected linears: "
                   + "; ".join(f"{t.name} = {t.help}" for t in registry.targets().values()) + ".")
@click.option("--preset", type=click.Choice(("h3", "all-linears")), default=None,
              help="Layers to convert: h3 = the 4 linears of each DiT block (default for H3 "
                   "inputs); all-linears = every 2-D float weight (default otherwise).")
@click.option("--include", multiple=True, metavar="REGEX",
              help="Only convert layers whose name matches (re.search; repeatable). Patterns: "
                   "at most 65,536 characters, no backreferences, lookarounds or inline flags "
                   "(matched in bounded time).")
@click.option("--exclude", multiple=True, metavar="REGEX",
              help="Never convert layers whose name matches (repeatable).")
@click.option("--layer", "layer_rules", multiple=True, metavar="REGEX=FORMAT",
              help="Per-layer format (repeatable; the first matching rule wins, before "
                   "--recipe's rules; unmatched layers get --to). FORMAT is a --to choice or "
                   "keep, with options: w4a8, int8-convrot:g=64, int8:layout=npu, bf16, keep.")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False, path_type=str),
              help="A JSON recipe: the same rules as data (written by 'h3quant plan' or by "
                   "hand); see docs/FORMATS.md, Recipes. A regular file of at most 16 MiB; it is "
                   "an input (no output may name it).")
@click.option("--group-size", type=int, default=256, show_default=True, callback=_group_size,
              help="ConvRot group size (a power of 4).")
@click.option("--rotation", type=click.Choice(["exact", "fast"]), default="exact", show_default=True,
              help="int8 ConvRot rotation: 'exact' gives codes bit-identical to comfy-kitchen; "
                   "'fast' factors the Hadamard: convert encodes on the CPU, where that is two "
                   "small matmuls per block (16-point factors), not the butterfly passes used "
                   "on other devices. Equal to fp32 rounding but a few codes per million differ "
                   "by 1; ~1.3x faster to encode here.")
@click.option("--layout", type=click.Choice(["canonical", "npu"]), default="canonical",
              show_default=True,
              help="int8 weight layout: canonical = int8_tensorwise [N, K] (ComfyUI, kitchen); "
                   "npu = int8_tensorwise_kn, pre-transposed [K, N] with an [N] scale, which "
                   "Ascend's npu_quant_matmul takes as is (ComfyUI does not load it). From an "
                   "int8 file the change of layout only moves the codes (no requantization).")
@click.option("--naming", type=click.Choice(["auto", *layouts.names()]),
              default="auto", show_default=True,
              help="Naming of IN: auto detects it (diffusers names; official = model-NNNNN-of-"
                   "MMMMM shards, whose names equal ComfyUI's but whose fused q/k/v rows are "
                   "per head). A non-ComfyUI or fp8 input is read as ComfyUI's single file "
                   "(renames, q/k/v fused in ComfyUI's row order, SwiGLU halves swapped, fp8 "
                   "decoded to fp32) and OUT is ComfyUI's single file; nothing is staged.")
@click.option("--lora", "loras", multiple=True, metavar="FILE[:STRENGTH]",
              help="Bake a LoRA into the weights before any rotation or encoding: W + strength "
                   "x (alpha / rank) x B @ A, summed in float64 and rounded once to the layer's "
                   "dtype. Repeatable (applied in order); STRENGTH defaults to 1.0 and may be "
                   "negative. Key styles: ComfyUI / musubi-tuner, kohya, diffusers / PEFT (split "
                   "to_q/to_k/to_v land in the fused rows; SwiGLU order mapped). From a "
                   "quantized IN without --to, the touched layers are decoded, merged and "
                   "encoded again in IN's own format. Checked from its header before any data "
                   "is read: rank at most 1024, F32/F16/BF16 adapters, each adapter once.")
@click.option("--lora-promote", type=click.Choice(_TARGETS), default=None,
              help="Write every layer a LoRA touches in this format instead (e.g. "
                   "int8-convrot in a W4A8 file: 4-bit rounding can eat a small delta; the "
                   "report's 'kept' share says how much survives).")
@click.option("--lora-skip-unmatched", is_flag=True,
              help="Skip LoRA keys that fit no layer of IN (listed) instead of refusing.")
@click.option("--calibration", "calibration", type=click.Path(dir_okay=False, path_type=str),
              default=None,
              help="Statistics from 'h3quant capture IN' (measured on this very checkpoint): "
                   "int8, int8-convrot, w4a8, nvfp4 and int4-convrot layers keep their usual "
                   "scales (and W4A8 its codebook) but choose their codes by error feedback on "
                   "your inputs; the "
                   "file format is unchanged; awq-w4a16 is written only this way. Layers "
                   "with fewer recorded rows than their input width are rounded to nearest "
                   "(warned). Other formats are rounded to nearest.")
@inputs_option(dest="calibrate_on", name="--calibrate-on", help=(
    "Calibrate in one pass on these inputs files (what 'capture --inputs' takes: files, "
    "folders, globs, quoted or not), no statistics file: block by block, each block's "
    "statistics are collected, its layers encoded with them and the statistics dropped. "
    "Progress per block and phase with an ETA on stderr; an interrupted run resumes from "
    "its last finished block (work folder OUT.h3q-onepass)."))
@click.option("--feedback", type=click.Choice(["float", "quantized"]), default="float",
              show_default=True,
              help="With --calibrate-on: the next block is measured on the outputs of the "
                   "float block (the statistics 'capture' gives: the same bytes as capture + "
                   "--calibration) or of the block as quantized (what the file will run; "
                   "slower, and no better in docs/calibration.md's measurement).")
@click.option("--device", default="cpu", show_default=True, callback=device_callback(True),
              help=f"With --calibrate-on: where the capture (the float forward and the "
                   f"statistics) and the feedback run: {device_help(auto=False)}. The "
                   "statistics accumulate in float32 (H = X^T X) there, the channel magnitudes "
                   "in float64 (on the host for a device without float64, MPS); the layers are "
                   "encoded on the CPU. Another device may round the float forward differently, "
                   "so the bytes can differ from a CPU run's.")
@memory_budget_option
@click.option("--calibration-heldout", type=click.Path(dir_okay=False, path_type=str),
              default=None,
              help="Statistics of other inputs (captured on IN too): the report also gives "
                   "each layer's output SQNR on them. Changes no byte.")
@click.option("--no-awq-scale", is_flag=True,
              help="With --calibration: write awq-w4a16 layers without AWQ's per-input-channel "
                   "scaling (by default out_proj and fc2 are searched for channel scales, "
                   "folded into the v rows of qkv_proj and the up rows of fc1).")
@click.option("--smooth", type=click.Choice(["auto", "off"]), default="off", show_default=True,
              help="With --calibration or --calibrate-on (float feedback: block by block, "
                   "from each block's own statistics): search per layer for channel factors "
                   "that move "
                   "activation outliers into the weights (SmoothQuant class), modelled on the "
                   "target format's activation rounding, and fold them exactly into the "
                   "block's norm weights, adaLN shift rows and the v / up rows (tensors ComfyUI "
                   "already loads); a layer is smoothed only where the model says it helps. "
                   "Needs statistics from this version of 'h3quant capture'.")
@click.option("--activation-aware", type=click.Choice(["auto", "off"]), default="off",
              show_default=True,
              help="With --calibration: error feedback minimises the layer's error with its "
                   "inputs rounded as the runtime rounds them (int4 per token for "
                   "int4-convrot, int8 per token for w4a8 and int8), modelled from the "
                   "statistics' sampled rows; formats run with float activations are "
                   "unaffected. Needs statistics from this version of 'h3quant capture'.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT.")
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan / report as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=str),
              help="Write the per-layer error report (JSON) to this file.")
@click.option("--no-report", is_flag=True, help="Skip the per-layer error measurement.")
@click.option("--workers", type=WORKERS, default=None,
              help="Threads encoding row chunks in parallel (default: one per CPU, at most 8; "
                   "torch then runs one intra-op thread per worker).")
@mmap_option
@handle_errors
def command(src, dst, target, preset, include, exclude, layer_rules, recipe_path, group_size,
            rotation, layout, naming, loras, lora_promote, lora_skip_unmatched, calibration,
            calibrate_on, feedback, device, memory_budget, calibration_heldout, no_awq_scale,
            smooth, activation_aware,
            overwrite, dry_run, as_json,
            quiet, report_path, no_report, workers, no_mmap):
    """Convert checkpoint IN to OUT (a file, or a directory for sharded input).

    Without OUT the output goes beside IN, named after it and the target
    (h3_bf16.safetensors -> h3_bf16_int8-convrot.safetensors; a Hugging Face cache snapshot's
    output goes to the current directory, never into the cache); an existing file of that
    name is never replaced: name OUT then.

    Only the selected linears are re-encoded; every other tensor is copied byte for byte.
    Nothing is left at OUT if anything fails; OUT == IN is refused. The output is written to a
    temporary file beside OUT and renamed when complete; the same input and options always give
    the same bytes. Exit status: 0 ok, 1 a layer failed or its source data breaks a rule (nothing
    written), 2 usage or I/O error (nothing written).

    \b
    Examples:
      h3quant convert h3_bf16.safetensors h3_int8.safetensors --to int8-convrot --report r.json
      h3quant convert h3_bf16.safetensors       # writes h3_bf16_int8-convrot.safetensors
      h3quant convert h3_bf16.safetensors h3_w4a8.safetensors --to w4a8
      h3quant convert h3_bf16.safetensors h3_fp8.safetensors --to fp8     # ComfyUI's float8_e4m3fn
      h3quant convert h3_fp8_scaled.safetensors h3_mxfp8.safetensors --to mxfp8
      h3quant convert h3_bf16.safetensors h3_nvfp4.safetensors --to nvfp4
      h3quant convert h3_bf16.safetensors h3_int4.safetensors --to int4-convrot   # convrot_w4a4
      h3quant convert h3_nvfp4.safetensors h3_int8.safetensors --to int8-convrot  # from nvfp4
      h3quant convert h3_int8.safetensors h3_back.safetensors --to bf16
      h3quant convert h3_int8.safetensors h3_npu.safetensors --layout npu   # Ascend-ready
      h3quant convert in.safetensors out.safetensors --dry-run          # show the plan only
      h3quant convert model.safetensors.index.json out_dir/ --exclude 'blocks\\.0\\.'
      h3quant convert FL2VA/transformer h3_int8.safetensors          # official shards
      h3quant convert transformer/ h3_bf16.safetensors --to bf16     # diffusers: re-layout
      h3quant convert h3_bf16.safetensors h3_int8_lora.safetensors --lora style.safetensors:0.8
      h3quant convert h3_bf16.safetensors mixed.safetensors --to w4a8 \\
          --layer 'blocks\\.(0|1|48|49)\\.=int8-convrot'           # int8 edge blocks
      h3quant convert h3_bf16.safetensors mixed.safetensors --to int8-convrot \\
          --layer 'mlp\\.=nvfp4'                                 # nvfp4 MLP, int8 attention
      h3quant convert h3_bf16.safetensors planned.safetensors --recipe recipe.json
      h3quant capture h3_bf16.safetensors --inputs steps/*.safetensors --out h3.stats
      h3quant convert h3_bf16.safetensors h3_w4a8_cal.safetensors --to w4a8 \\
          --calibration h3.stats --report r.json              # calibrated codes
      h3quant convert h3_bf16.safetensors h3_w4a8_cal.safetensors --to w4a8 \\
          --calibrate-on steps/*.safetensors                    # one pass, no statistics file
      h3quant convert h3_bf16.safetensors h3_int4.safetensors --to int4-convrot \\
          --calibration h3.stats --smooth auto --activation-aware auto
    """
    from h3quant.cli.render import render_plan, summary_line

    if dst is None:
        dst = default_output(src, target, layout)
        if os.path.lexists(dst):
            raise click.UsageError(f"OUT not given and the default output {dst} exists; it is "
                                   "never replaced: name OUT")
        log(f"output: {dst}")
    from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
    from h3quant.pipelines.convert.recipe import load_recipe, parse_rule

    if no_report and report_path:
        raise ConvertError("--report and --no-report contradict each other")
    from h3quant.formats.container.iofiles import CommandFiles
    from h3quant.pipelines.convert import register_files

    # every file this run reads and writes, checked before anything is read: no output may
    # name an input (IN, a shard, a --lora file, the --recipe)
    files = CommandFiles("convert")
    files.read(recipe_path, "recipe")
    register_files(files, src, dst, loras, report_path)
    files.check(overwrite=overwrite)
    if lora_promote and not loras:
        raise ConvertError("--lora-promote needs --lora (it names the layers a LoRA touches)")
    ctx = click.get_current_context()
    if loras and ctx.get_parameter_source("target") == click.core.ParameterSource.DEFAULT:
        from h3quant.pipelines.convert import native_target

        native = guard("reading IN", native_target, src, naming, mmap=not no_mmap)
        if native is not None:  # a quantized input: its layers keep their own format
            target = native[0]
            if ctx.get_parameter_source("group_size") == click.core.ParameterSource.DEFAULT:
                group_size = native[1]
            if ctx.get_parameter_source("layout") == click.core.ParameterSource.DEFAULT:
                layout = native[2]
            if not quiet:
                log(f"--to not given: the LoRA layers are encoded again as IN stores them "
                    f"({target}, group size {group_size}, layout {layout})")
    if feedback != "float" and not calibrate_on:
        raise click.UsageError("--feedback applies to --calibrate-on")
    if memory_budget is not None and not calibrate_on:
        raise click.UsageError("--memory-budget applies to --calibrate-on")
    if device != "cpu" and not calibrate_on:
        raise click.UsageError("--device applies to --calibrate-on (the layers are encoded on "
                               "the CPU)")
    rules = tuple(parse_rule(r) for r in layer_rules)
    if recipe_path:
        rules += load_recipe(recipe_path)
    options = ConvertOptions(target=target, preset=preset, include=tuple(include),
                             exclude=tuple(exclude), layers=rules, group_size=group_size,
                             report=not no_report, workers=workers, mmap=not no_mmap,
                             overwrite=overwrite, rotation=rotation, layout=layout,
                             naming=naming, loras=tuple(loras),
                             lora_skip_unmatched=lora_skip_unmatched, lora_promote=lora_promote,
                             calibration=calibration, calibration_heldout=calibration_heldout,
                             awq_scale=not no_awq_scale, smooth=smooth,
                             calibrate_on=tuple(calibrate_on), feedback=feedback,
                             memory_budget=memory_budget, device=device,
                             activation_aware=activation_aware)
    if dry_run:
        plan = guard("planning the conversion", plan_convert, src, dst, options)
        if as_json:
            emit_json(plan.to_dict())
        else:
            click.echo(render_plan(plan.to_dict()))
        return
    say = (lambda msg: None) if quiet else log
    from h3quant.formats.container.signals import committed_outputs, interrupt_outcome

    done_before = len(committed_outputs())
    try:
        report = guard("converting (nothing was written)", convert, src, dst, options,
                       progress=progress_enabled(quiet), log=say,
                       report_path=report_path, files=files)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (formats.container.signals)
        # Everything is cleaned up by now (or every output is complete, when the signal came
        # after the final move: exit 0 then). Exit at once rather than wait at interpreter exit
        # for worker threads still inside an encoder call (a W4A8 layer can take a minute).
        code, message = interrupt_outcome(exc, done_before)
        log(message)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if as_json:
        emit_json(report.to_dict())
    if not quiet:
        converted = report.counts["convert"]
        log(f"wrote {dst}: {size_text(report.output_bytes)}, {converted} layer(s) converted, "
            f"{report.copied['tensors']} tensor(s) copied, {report.elapsed_s:.1f} s "
            f"({report.input_mb_per_s} MB/s of input)")
        lora = report.to_dict().get("lora")
        if lora and lora.get("survival"):
            kept = [r["kept"] for r in lora["survival"]]
            log(f"LoRA baked into {len(kept)} layer(s); share of the delta kept after encoding: "
                f"min {min(kept):.0%}, median {sorted(kept)[len(kept) // 2]:.0%}")
        for lay in report.layers:
            if lay["action"] == "skip":
                log(f"skipped {lay['name']}: {lay['reason']}")
        if options.report and converted:
            log(summary_line(report.summary, converted))
        _load_lines(report.layers, log)


def _load_lines(layers, log) -> None:
    """Will the output load, and where does it run fast: one line per written format."""
    import textwrap

    from h3quant.pipelines.loaders import load_lines

    made = {str(lay["to"]).split()[0] for lay in layers if lay["action"] != "skip" and lay["to"]}
    for fmt, text in load_lines(made).items():
        log(textwrap.fill(f"{fmt}: {text}", 100, initial_indent="loads: ",
                          subsequent_indent="  "))
