"""`h3quant demo`: the whole job end to end on a built-in synthetic H3 checkpoint."""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path

import click

from h3quant.cli.common import handle_errors, log


def _run(args: list[str]) -> int:
    """Run one h3quant command in-process, echoing it as a shell line; return its exit code."""
    from h3quant.cli import main

    log("\n$ h3quant " + " ".join(shlex.quote(a) for a in args))
    try:
        main.main(args, prog_name="h3quant", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    return 0


@click.command("demo")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the files in this directory (default: a temporary one, removed after).")
@click.option("--preset", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True,
              help="Size of the synthetic H3 checkpoint.")
@click.option("--blocks", type=int, default=2, show_default=True, help="DiT blocks to synthesise.")
@click.option("--device", default="auto", show_default=True, help="Device for the verify step.")
@handle_errors
def command(workdir: Path | None, preset: str, blocks: int, device: str) -> None:
    """Run synth -> convert (int8-convrot and w4a8) -> inspect -> validate -> verify.

    Real H3 weights cannot be downloaded here, so the demo makes an H3-shaped bf16 checkpoint with
    the real key names and dtypes (widths scaled down with --preset tiny), then runs every step a
    user runs on a real file. Exit 0 only when every step passed.

    \b
    Examples:
      h3quant demo
      h3quant demo --dir ./demo --blocks 4
    """
    with tempfile.TemporaryDirectory(prefix="h3quant-demo-") as tmp:
        root = workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        bf16 = str(root / "h3_bf16.safetensors")
        int8 = str(root / "h3_int8_convrot.safetensors")
        w4a8 = str(root / "h3_w4a8.safetensors")
        report = str(root / "h3_int8_convrot.report.json")
        steps = [
            ["synth", bf16, "--preset", preset, "--blocks", str(blocks), "--overwrite"],
            ["convert", bf16, int8, "--to", "int8-convrot", "--overwrite", "--report", report],
            ["convert", bf16, w4a8, "--to", "w4a8", "--overwrite"],
            ["inspect", int8],
            ["validate", int8, "--deep"],
            ["validate", w4a8, "--deep"],
            ["verify", int8, "--reference", bf16, "--device", device],
            ["verify", w4a8, "--reference", bf16, "--device", device],
        ]
        failed = []
        for args in steps:
            code = _run(args)
            if code != 0:
                failed.append((args[0], code))
                log(f"h3quant demo: step '{args[0]}' exited {code}")
                if args[0] in ("synth", "convert"):
                    break
        if failed:
            log(f"\nh3quant demo: FAILED ({', '.join(f'{s}: exit {c}' for s, c in failed)})")
            sys.exit(1)
        where = f" (files kept in {root})" if workdir else ""
        log(f"\nh3quant demo: all {len(steps)} steps passed{where}")
