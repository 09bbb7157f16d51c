"""``h3quant validate``: check a checkpoint against every rule; exit 1 when an error is found."""

from __future__ import annotations

import sys

import click

from h3quant.cli.common import (
    CHECKPOINT,
    EXIT_FINDINGS,
    EXIT_OK,
    emit_json,
    format_table,
    guard,
    handle_errors,
    mmap_option,
    progress_enabled,
)


def _codes(as_json: bool) -> None:
    from h3quant.findings import all_rules
    from h3quant.formats import registry  # noqa: F401 (the format packages register their codes)

    rules = all_rules()
    if as_json:
        emit_json([{"code": r.code, "name": r.name, "severity": r.severity.value, "rule": r.rule}
                   for r in rules])
    else:
        click.echo(format_table(["code", "severity", "name", "rule"],
                                [[r.code, r.severity.value, r.name, r.rule] for r in rules]))


def render(res) -> str:
    lines = [str(f) + (f"  [{f.file}]" if f.file and f.file != res.path else "")
             for f in res.findings]
    # will it load, and where: before the verdict, which stays the last line
    lines += [wrapped(f"{fmt}: {text}", "loads  ") for fmt, text in res.loads.items()]
    if res.loader is not None:
        lines.append(f"loader {res.loader}: " + ("takes this file" if res.ok else
                                                 "refuses this file (errors above)"))
    c = res.counts
    verdict = "OK" if res.ok else "FAILED"
    chk = res.checked
    lines.append(f"{verdict}: {c['error']} errors, {c['warning']} warnings, {c['info']} notes "
                 f"({chk.get('tensors', 0)} tensors, {chk.get('layers', 0)} layers, "
                 f"{chk.get('quantized_layers', 0)} quantized; checks: "
                 f"{', '.join(chk.get('stages', []))}) in {res.path}")
    return "\n".join(lines)


def wrapped(text: str, first: str) -> str:
    import textwrap

    return textwrap.fill(text, 100, initial_indent=first, subsequent_indent=" " * 9)


@click.command("validate", epilog="""\b
Exit status: 0 no errors (warnings allowed), 1 errors found, 2 usage or I/O problem.
\b
Examples:
  h3quant validate model.safetensors
  h3quant validate model.safetensors --deep          # also read and check every value
  h3quant validate model.safetensors.index.json --json
  h3quant validate model.safetensors --loader vllm-omni   # would vllm-omni take it?
  h3quant validate model.gguf --loader comfyui-gguf
  h3quant validate --codes                           # list every rule""")
@click.argument("ckpt", type=CHECKPOINT, required=False)
@click.option("--deep", is_flag=True,
              help="Also read tensor data: finite positive scales, int8 code range, codebooks, "
                   "finite float weights (one layer at a time, bounded memory).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document: ok, counts by severity and every finding "
                   "(code, name, severity, tensor, file, message).")
@click.option("--codes", is_flag=True,
              help="Print the rule registry (every finding code) and exit.")
@click.option("--loader", type=click.Choice(["comfyui", "vllm-omni", "comfyui-gguf"]),
              default=None,
              help="Also apply this loader's published acceptance rules (findings L1xx): "
                   "ComfyUI's own, vllm-omni's H3 INT8 ConvRot loader, or ComfyUI-GGUF's. "
                   "Exit 1 when that loader would refuse the file.")
@mmap_option
@click.option("--quiet", "-q", is_flag=True, help="No progress bar on stderr (--deep).")
@handle_errors
def command(ckpt: str | None, deep: bool, as_json: bool, codes: bool, loader: str | None,
            no_mmap: bool, quiet: bool = False) -> None:
    """Check a checkpoint against the container, marker, scheme and H3 topology rules.

    CKPT is a .safetensors file, a *.safetensors.index.json shard index, or a directory.
    Every problem is reported as a coded finding (see --codes) naming the tensor, what is
    wrong and what was expected; a broken file never produces a traceback.
    """
    if codes:
        _codes(as_json)
        return
    if ckpt is None:
        raise click.UsageError("missing argument CKPT (or use --codes)")
    from h3quant.pipelines.headers.validate import validate_checkpoint

    bar = None
    if deep and progress_enabled(quiet):
        from tqdm import tqdm

        bar = tqdm(total=None, unit="B", unit_scale=True, desc="deep check", file=sys.stderr,
                   leave=False)
    try:
        res = guard("validating", validate_checkpoint, ckpt, deep=deep, mmap=not no_mmap,
                    on_bytes=bar.update if bar is not None else None, loader=loader)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(render(res))
    sys.exit(EXIT_OK if res.ok else EXIT_FINDINGS)
