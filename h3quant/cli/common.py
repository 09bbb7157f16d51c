"""Shared CLI plumbing: error -> exit code mapping, JSON output, stderr logging."""

from __future__ import annotations

import functools
import json
import os
import sys

import click

from h3quant.errors import H3QuantError

EXIT_OK = 0
EXIT_FINDINGS = 1  # the command ran and found the input wrong (validate / verify failures)
EXIT_USAGE = 2  # bad usage, unreadable input, refused output


def handle_errors(func):
    """Turn h3quant errors into one clear stderr line and an exit code, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except H3QuantError as exc:
            click.echo(f"h3quant: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("h3quant: interrupted", err=True)
            sys.exit(130)
        except MemoryError:
            click.echo("h3quant: error: out of memory", err=True)
            sys.exit(EXIT_USAGE)
        except OSError as exc:
            where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
            click.echo(f"h3quant: error:{where}: {exc.strerror or exc}", err=True)
            sys.exit(EXIT_USAGE)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug: say so in one line, no traceback unless asked
            if os.environ.get("H3QUANT_DEBUG"):
                raise
            click.echo(f"h3quant: error: unexpected {type(exc).__name__}: {exc} "
                       "(set H3QUANT_DEBUG=1 for a traceback)", err=True)
            sys.exit(EXIT_USAGE)

    return wrapper


def emit_json(obj) -> None:
    """Machine output on stdout: stable key order, one document."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def log(message: str) -> None:
    """Human progress and notes go to stderr; stdout stays data."""
    click.echo(message, err=True)


def mmap_option(func):
    return click.option(
        "--no-mmap", "no_mmap", is_flag=True,
        help="Read with plain buffered I/O instead of memory-mapping (for stacks that stall in "
             "mmap page faults on large files).",
    )(func)


def format_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> str:
    """A plain text table; columns in ``right`` are right-aligned."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = line(["-" * w for w in widths])
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def guard(what: str, fn, *args, **kwargs):
    """Run a pipeline; an unexpected exception becomes one clear error line (exit 2)."""
    try:
        return fn(*args, **kwargs)
    except (H3QuantError, OSError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:
        if os.environ.get("H3QUANT_DEBUG"):
            raise
        raise H3QuantError(f"unexpected {type(exc).__name__} while {what}: {exc} "
                           "(set H3QUANT_DEBUG=1 for a traceback)") from None
