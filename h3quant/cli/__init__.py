"""The ``h3quant`` command line: a click group; each command lives in its own module."""

from __future__ import annotations

import importlib

import click

from h3quant import __version__

# command name -> module under h3quant.cli defining a click command named ``command``
_COMMANDS = {
    "synth": "synth_cmd",
    "inspect": "inspect_cmd",
    "validate": "validate_cmd",
    "convert": "convert_cmd",
    "verify": "verify_cmd",
    "backends": "backends_cmd",
    "demo": "demo_cmd",
}


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
            raise
        return mod.command


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
    """
