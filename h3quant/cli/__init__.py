"""The ``h3quant`` command line: a click group; each command lives in its own module."""

from __future__ import annotations

import importlib
import os
import sys

import click

from h3quant import __version__

# command name -> module under h3quant.cli defining a click command named ``command``
_COMMANDS = {
    "synth": "synth_cmd",
    "synth-lora": "synth_lora_cmd",
    "inspect": "inspect_cmd",
    "validate": "validate_cmd",
    "convert": "convert_cmd",
    "capture": "capture_cmd",
    "verify": "verify_cmd",
    "plan": "plan_cmd",
    "compare": "compare_cmd",
    "backends": "backends_cmd",
    "demo": "demo_cmd",
}


def _needs_torch(name: str) -> click.Command:
    """A stand-in for a command whose module needs PyTorch when PyTorch is not installed: it
    says so (exit 2) instead of failing on the import."""
    from h3quant.cli.common import EXIT_USAGE, torch_missing_message

    def callback(args):
        click.echo(f"h3quant: error: {torch_missing_message(name)}", err=True)
        sys.exit(EXIT_USAGE)

    cmd = click.Command(name, callback=callback, add_help_option=False,
                        help="(needs PyTorch: pip install 'h3quant[torch]')",
                        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
                        context_settings={"ignore_unknown_options": True})
    setattr(cmd, "_h3quant_epilog", True)
    return cmd


class _LazyGroup(click.Group):
    """Imports a command's module only when that command runs (keeps `--help` and start-up fast)."""

    def list_commands(self, ctx):
        return [name for name in _COMMANDS if self._load(name) is not None]

    def get_command(self, ctx, name):
        return self._load(name)

    @staticmethod
    def _load(name):
        module = _COMMANDS.get(name)
        if module is None:
            return None
        try:
            mod = importlib.import_module(f"h3quant.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"h3quant.cli.{module}":
                return None  # command not built yet
            from h3quant.cli.common import is_torch_missing

            if is_torch_missing(exc):
                return _needs_torch(name)
            raise
        cmd = mod.command
        if not getattr(cmd, "_h3quant_epilog", False):
            from h3quant.cli.common import EXIT_EPILOG

            cmd.epilog = f"{cmd.epilog}\n\n{EXIT_EPILOG}" if cmd.epilog else EXIT_EPILOG
            setattr(cmd, "_h3quant_epilog", True)
        return cmd

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Usage errors in h3quant's one error style (``h3quant: error: ...``, exit 2)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            echo_click_error(exc)
            sys.exit(exc.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("h3quant: interrupted", err=True)
            sys.exit(130)
        except ModuleNotFoundError as exc:  # e.g. an option's check that loads the runtime
            from h3quant.cli.common import EXIT_USAGE, is_torch_missing, torch_missing_message

            if not is_torch_missing(exc):
                raise
            name = next((a for a in (args or sys.argv[1:]) if a in _COMMANDS), None)
            click.echo(f"h3quant: error: {torch_missing_message(name)}", err=True)
            sys.exit(EXIT_USAGE)
        sys.exit(0)


def echo_click_error(exc: click.ClickException) -> None:
    """One line in the style of every other h3quant error, plus where to find help."""
    from h3quant.cli.common import printable

    msg = printable(exc.format_message())
    if msg.startswith("Invalid value"):
        msg = "i" + msg[1:]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    click.echo(f"h3quant: error: {msg}{hint}", err=True)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="h3quant")
def main() -> None:
    """Inspect, validate, convert and verify quantized MiniMax H3 safetensors checkpoints.

    \b
    Quick start (no real weights needed):
      h3quant demo                      # synth -> convert -> inspect -> validate -> verify
      h3quant synth h3.safetensors      # a tiny synthetic H3-shaped checkpoint
      h3quant inspect h3.safetensors --layers
      h3quant validate h3.safetensors --deep

    Exit status (every command): 0 ok, 1 the input is wrong (findings, failed check or layer),
    2 usage or I/O error (nothing written), 3 internal error (a bug: please report it with the
    output of H3QUANT_DEBUG=1), 128+N stopped by signal N (nothing left behind).
    """


# Commands whose successful run leaves nothing for the interpreter's teardown to do: every
# output is committed (renamed and fsynced) and every thread joined before the command returns.
_FAST_EXIT = frozenset({"convert"})


def run(argv: list[str] | None = None) -> None:
    """The process entry point (the ``h3quant`` console script and ``python -m h3quant``).

    Runs ``main``. After a successful ``convert`` the process ends with ``os._exit`` once stdout
    and stderr are flushed: tearing down an interpreter that has loaded torch takes about 0.5 s
    of CPU on a small machine, after the output is already in place. Anything else (other
    commands, any failure, a flush error) exits the normal way.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        main.main(args, prog_name="h3quant")
        code: str | int | None = 0
    except SystemExit as exc:
        code = exc.code
    if code in (0, None) and args[:1] and args[0] in _FAST_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # e.g. a closed pipe: the normal exit reports it
            pass
        else:
            os._exit(0)
    sys.exit(code)
