"""``plan --device CLASS --vram SIZE``: the machine plan's options and its rendering."""

from __future__ import annotations

import re
import textwrap

import click

from h3quant.cli.common import emit_json, format_table, guard
from h3quant.sizes import size_text

_RES = re.compile(r"^\s*(\d{2,5})\s*[xX]\s*(\d{2,5})\s*$")


def parse_resolution(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = _RES.match(text)
    if not m or not (16 <= int(m.group(1)) <= 8192 and 16 <= int(m.group(2)) <= 8192):
        raise click.BadParameter(f"{text!r} is not WxH with sides 16..8192 (e.g. 1280x720)",
                                 param_hint="--resolution")
    return int(m.group(1)), int(m.group(2))


def render(plan) -> str:
    w, h = plan.resolution
    cur = plan.current
    out = [f"device     {plan.device_class}: {plan.label}, {size_text(plan.vram)} of memory",
           f"video      {w}x{h}, {plan.frames} frames: {plan.tokens:,} video tokens, "
           f"activations {size_text(plan.activations)}"]
    for what, n in plan.extra.items():
        out.append(f"{what.replace('_', ' '):<10} {size_text(n)} of weights")
    out.append(f"this file  {', '.join(cur['formats'])}: weights {size_text(cur['weights'])}, "
               f"estimate {size_text(cur['total'])} ({'fits' if cur['fits'] else 'does not fit'})")
    out.append("")
    rows = [[c.target, size_text(c.weights), size_text(c.total), c.cell, "yes" if c.fits else "no"]
            for c in plan.candidates]
    out.append(format_table(["--to", "weights", "estimate", f"on {plan.device_class}", "fits"],
                            rows, {1, 2}))
    out.append("")
    out.append(f"plan: {plan.verdict}")
    out += [textwrap.fill(s, 100, initial_indent="  - ", subsequent_indent="    ")
            for s in plan.suggestions]
    out.append("assumptions (estimates, not measurements):")
    out += [textwrap.fill(a, 100, initial_indent="  - ", subsequent_indent="    ")
            for a in plan.assumptions]
    return "\n".join(out)


def run_machine_plan(ctx, src, device_class, vram, resolution, frames, text_encoder, vae,
                     any_format, as_json, mmap) -> None:
    from click.core import ParameterSource

    from h3quant.formats.container.iofiles import CommandFiles
    from h3quant.pipelines.plan.machine import plan_for_machine

    if device_class is None or vram is None:
        raise click.UsageError("--device and --vram go together (e.g. --device ada --vram 16GB)")
    typed = {n for n in ("target_sqnr", "max_size", "out_path", "frontier", "from_json",
                         "calibration", "per_layer")
             if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE}
    if typed:
        raise click.UsageError("--device plans for a machine from headers; it takes none of "
                               "--target-sqnr, --max-size, --out, --frontier, --from, "
                               "--calibration, --per-layer")
    files = CommandFiles("plan")
    files.checkpoint(src)
    files.read(text_encoder, "--text-encoder")
    files.read(vae, "--vae")
    given = ctx.get_parameter_source("frames") is ParameterSource.COMMANDLINE
    plan = guard("planning for the machine", plan_for_machine, src, device_class, vram,
                 resolution=parse_resolution(resolution), frames=frames if given else None,
                 text_encoder=text_encoder, vae=vae, any_format=any_format, mmap=mmap)
    if as_json:
        emit_json(plan.to_dict())
    else:
        click.echo(render(plan))
