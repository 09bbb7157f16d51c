"""``--inputs`` as every command reads it: several values after one option, repeatable.

    @inputs_option(help="...")
    def command(..., inputs): ...   # inputs: a tuple of strings, expanded by the pipeline

``--inputs a.safetensors b.safetensors``, ``--inputs steps/*.safetensors`` (expanded by the
shell into many words, or quoted and expanded by ``pipelines.inputs_file.expand_inputs``, as on
Windows), ``--inputs steps/`` and ``--inputs a --inputs b`` all give the same list: the option
takes every following word up to the next one that starts with ``-``.
"""

from __future__ import annotations

import click

METAVAR = "FILE|FOLDER|GLOB..."


class ManyValues(click.Option):
    """A repeatable option that also takes every following word that is not an option."""

    def add_to_parser(self, parser, ctx) -> None:
        super().add_to_parser(parser, ctx)
        table = {**getattr(parser, "_long_opt", {}), **getattr(parser, "_short_opt", {})}
        for name in self.opts:
            opt = table.get(name)
            if opt is None:
                continue
            first = opt.process

            def process(value, state, first=first):
                first(value, state)
                while state.rargs and not state.rargs[0].startswith("-"):
                    first(state.rargs.pop(0), state)

            opt.process = process


def inputs_option(help: str, *, required: bool = False, dest: str = "inputs",
                  name: str = "--inputs"):
    """The ``--inputs`` option (or another of its kind, ``name``): a tuple of the words given
    (empty when absent)."""
    return click.option(name, dest, cls=ManyValues, multiple=True, required=required,
                        metavar=METAVAR, help=help)


def one_input(values) -> str | None:
    """The one inputs file that ``values`` name (None when none), for the commands that run
    one call (verify --model, plan, compare); a usage error naming the files when several."""
    if not values:
        return None
    from h3quant.pipelines.inputs_file import single_input

    return str(single_input(values))


__all__ = ["METAVAR", "ManyValues", "inputs_option", "one_input"]
