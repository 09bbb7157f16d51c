"""`h3quant demo`: the whole job end to end on a built-in synthetic H3 checkpoint."""

from __future__ import annotations

import contextlib
import shlex
import sys
import tempfile
from pathlib import Path

import click

from h3quant.cli.common import MAX_BLOCKS, device_callback, handle_errors


def say(message: str) -> None:
    """A line of the demo's log. The log is the demo's output: one stream (stdout), in order."""
    click.echo(message)


def _run(args: list[str]) -> int:
    """Run one h3quant command in-process, echoing it as a shell line; return its exit code.
    The step's notes (its stderr) join its results on stdout, so a captured log reads step by
    step: the command line, then everything it printed."""
    from h3quant.cli import main

    say("\n$ h3quant " + " ".join(shlex.quote(a) for a in args))
    try:
        with contextlib.redirect_stderr(sys.stdout):
            main.main(args, prog_name="h3quant", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code >= 128:  # a step was interrupted by a signal: stop the demo the same way
            raise
        return code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    finally:
        sys.stdout.flush()
    return 0


def _steps(root: Path, preset: str, blocks: int, device: str) -> list[list[str]]:
    """The demo's commands, as a user would type them, on files under ``root``."""
    bf16 = str(root / "h3_bf16.safetensors")
    int8 = str(root / "h3_int8_convrot.safetensors")
    w4a8 = str(root / "h3_w4a8.safetensors")
    report = str(root / "h3_int8_convrot.report.json")
    official = str(root / "h3_official")  # the release's layout: shards, q/k/v per head
    from_official = str(root / "h3_int8_from_official.safetensors")
    lora = str(root / "style_lora.safetensors")
    baked = str(root / "h3_int8_lora.safetensors")
    size = ["--preset", preset, "--blocks", str(blocks), "--overwrite"]
    return [
        ["synth", bf16, "--preset", preset, "--blocks", str(blocks), "--overwrite"],
        ["convert", bf16, int8, "--to", "int8-convrot", "--overwrite", "--report", report],
        ["convert", bf16, w4a8, "--to", "w4a8", "--overwrite"],
        ["inspect", int8],
        ["validate", int8, "--deep"],
        ["validate", w4a8, "--deep"],
        ["verify", int8, "--reference", bf16, "--device", device],
        ["verify", w4a8, "--reference", bf16, "--device", device],
        ["verify", int8, "--reference", bf16, "--model", "--device", device],
        ["verify", w4a8, "--reference", bf16, "--model", "--device", device],
        ["synth", official, "--naming", "official", *size],
        ["convert", official, from_official, "--overwrite"],
        ["validate", from_official, "--deep"],
        ["synth-lora", lora, "--style", "diffusers", *size],
        ["inspect", lora],
        ["convert", bf16, baked, "--lora", lora, "--overwrite"],
        ["validate", baked, "--deep"],
    ]


@click.command("demo")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the files in this directory (default: a temporary one, removed after).")
@click.option("--preset", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True,
              help="Size of the synthetic H3 checkpoint.")
@click.option("--blocks", type=click.IntRange(1, MAX_BLOCKS), default=2, show_default=True,
              help="DiT blocks to synthesise.")
@click.option("--device", default="auto", show_default=True, callback=device_callback(True),
              help="Device for the verify step (checked before any work).")
@handle_errors
def command(workdir: Path | None, preset: str, blocks: int, device: str) -> None:
    """Run synth -> convert (int8-convrot and w4a8) -> inspect -> validate -> verify (per block,
    then the whole model with --model); then convert the official release's layout and bake a
    LoRA.

    Real H3 weights cannot be downloaded here, so the demo makes an H3-shaped bf16 checkpoint with
    the real key names and dtypes (widths scaled down with --preset tiny), then runs every step a
    user runs on a real file. The log (each command line, then what it printed) goes to stdout
    in order: `h3quant demo > demo.log` captures it step by step. Exit status: 0 when every step
    passed, 1 a step failed, 2 usage error or a --dir holding files the demo did not write.

    \b
    Examples:
      h3quant demo
      h3quant demo --dir ./demo --blocks 4
    """
    from h3quant.errors import OutputError
    from h3quant.formats.container.atomic import is_own_output_dir, write_manifest

    if workdir is not None:
        if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
            raise OutputError("--dir must be a directory", path=workdir)
        if workdir.is_dir() and not is_own_output_dir(workdir):
            raise OutputError("--dir holds files the demo did not write; choose a new or empty "
                              "directory", path=workdir)
    with tempfile.TemporaryDirectory(prefix="h3quant-demo-") as tmp:
        root = workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        steps = _steps(root, preset, blocks, device)
        failed = []
        for args in steps:
            code = _run(args)
            if workdir is not None:
                write_manifest(root)  # marks the directory as the demo's own for the next run
            if code != 0:
                failed.append((args[0], code))
                say(f"h3quant demo: step '{args[0]}' exited {code}")
                if args[0] in ("synth", "synth-lora", "convert"):
                    break
        if failed:
            say(f"\nh3quant demo: FAILED ({', '.join(f'{s}: exit {c}' for s, c in failed)})")
            sys.exit(1)
        where = f" (files kept in {root})" if workdir else ""
        say(f"\nh3quant demo: all {len(steps)} steps passed{where}")
