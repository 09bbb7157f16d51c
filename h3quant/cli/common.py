"""Shared CLI plumbing: error -> exit code mapping, JSON output, stderr logging."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Set as AbstractSet
from pathlib import Path

import click

from h3quant.errors import H3QuantError, escape_controls
from h3quant.device_kinds import HOST

EXIT_OK = 0
EXIT_FINDINGS = 1  # the command ran and found the input wrong (validate / verify failures)
EXIT_USAGE = 2  # bad usage, unreadable input, refused output
EXIT_INTERNAL = 3  # a bug in h3quant (an exception nobody expected)

EXIT_CODES_HELP = ("Exit status: 0 ok, 1 the input is wrong, 2 usage or I/O error (nothing "
                   "written), 3 internal error (a bug: please report it with the output of "
                   "H3QUANT_DEBUG=1); 128+N killed by signal N (nothing left behind).")

EXIT_EPILOG = ("Exit status 3: internal error (a bug: please report it with the output of "
               "H3QUANT_DEBUG=1); 128+N: stopped by signal N, nothing left behind.")

_DEBUG_OFF = {"", "0", "false", "no", "off"}


def debug_enabled() -> bool:
    """``H3QUANT_DEBUG`` set to anything but empty/0/false/no/off shows tracebacks."""
    return os.environ.get("H3QUANT_DEBUG", "").strip().lower() not in _DEBUG_OFF


def internal_error_line(exc: BaseException, what: str | None = None) -> str:
    where = f" while {what}" if what else ""
    return (f"h3quant: internal error{where}: {type(exc).__name__}: {printable(str(exc))}\n"
            "h3quant: this is a bug in h3quant; please report it with the output of the same "
            "command run with H3QUANT_DEBUG=1")


class InternalError(Exception):
    """An unexpected exception (a bug), already described; exits with ``EXIT_INTERNAL``."""

    def __init__(self, exc: BaseException, what: str | None = None):
        super().__init__(str(exc))
        self.original = exc
        self.what = what


def handle_errors(func):
    """Turn h3quant errors into one clear stderr line and an exit code, never a traceback.

    SIGTERM and SIGHUP unwind like Ctrl-C while the command runs (``formats.container.atomic``), so its
    temporary outputs are removed; the exit status is then 128 + the signal number."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from h3quant.formats.container.signals import (
            committed_outputs,
            interrupt_outcome,
            terminate_on_signals,
        )

        from h3quant.cli.os_errors import is_out_of_memory, memory_line, os_error_line
        from h3quant.formats.container.iofiles import forget_current

        forget_current()
        done_before = len(committed_outputs())
        try:
            with terminate_on_signals():
                return func(*args, **kwargs)
        except H3QuantError as exc:
            click.echo(f"h3quant: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            # nothing written: 128 + N; every output already in place: 0, saying so
            code, message = interrupt_outcome(exc, done_before)
            click.echo(message, err=True)
            sys.exit(code)
        except MemoryError as exc:
            click.echo(memory_line(exc), err=True)
            sys.exit(EXIT_USAGE)
        except RecursionError as exc:  # nesting deeper than Python's stack: hostile input
            click.echo(f"h3quant: error: input nested too deeply to read ({exc})", err=True)
            sys.exit(EXIT_USAGE)
        except OSError as exc:
            click.echo(os_error_line(exc), err=True)
            sys.exit(EXIT_USAGE)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except ModuleNotFoundError as exc:
            if not is_torch_missing(exc):
                if debug_enabled():
                    raise
                click.echo(internal_error_line(exc), err=True)
                sys.exit(EXIT_INTERNAL)
            ctx = click.get_current_context(silent=True)
            click.echo(f"h3quant: error: {torch_missing_message(ctx.info_name if ctx else None)}",
                       err=True)
            sys.exit(EXIT_USAGE)
        except InternalError as exc:
            if is_torch_missing(exc.original):
                ctx = click.get_current_context(silent=True)
                click.echo(f"h3quant: error: "
                           f"{torch_missing_message(ctx.info_name if ctx else None)}", err=True)
                sys.exit(EXIT_USAGE)
            if debug_enabled():
                raise exc.original from None
            click.echo(internal_error_line(exc.original, exc.what), err=True)
            sys.exit(EXIT_INTERNAL)
        except Exception as exc:  # a bug: say so, no traceback unless asked
            if is_out_of_memory(exc):
                click.echo(memory_line(exc), err=True)
                sys.exit(EXIT_USAGE)
            if debug_enabled():
                raise
            click.echo(internal_error_line(exc), err=True)
            sys.exit(EXIT_INTERNAL)

    return wrapper


def is_torch_missing(exc: BaseException) -> bool:
    """True when ``exc`` says PyTorch is not installed (an optional dependency: ``inspect`` and
    ``validate`` work without it)."""
    return (isinstance(exc, ModuleNotFoundError)
            and (exc.name or "").split(".")[0] == "torch")


def torch_missing_message(command: str | None = None) -> str:
    what = ("'h3quant validate --deep'" if command == "validate" else f"'h3quant {command}'"
            if command else "this command")
    return (f"{what} needs PyTorch, which is not installed; install it with "
            "pip install 'h3quant[torch]' (or your platform's own torch build: CUDA, MPS, "
            "Ascend). 'h3quant inspect' and 'h3quant validate' (without --deep) work without it")


def printable(text: str) -> str:
    """``text`` with terminal control characters escaped (tensor names come from the file)."""
    return escape_controls(text)


def progress_enabled(quiet: bool = False) -> bool:
    """Progress bars only when stderr is a terminal (logs and pipes get none)."""
    if quiet:
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


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


def _memory_budget(ctx, param, value):
    from h3quant.sizes import parse_size

    if value is None:
        return None
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if n <= 0:
        raise click.BadParameter(f"{value!r}: the budget must be more than 0 bytes")
    return n


def memory_budget_option(func):
    return click.option(
        "--memory-budget", default=None, callback=_memory_budget, metavar="SIZE",
        help="Memory for the calls' hidden states (e.g. 8GB, 800MB, 2GiB; default: half the "
             "memory available at the start, 8 GB where the system does not say). Their size "
             "and whether they fit is printed before any work; beyond the budget they are "
             "spilled to disk (one file per call, read back as each block runs, removed at "
             "the end and on Ctrl-C / SIGTERM). A budget smaller than one call is refused.",
    )(func)


def format_table(headers: list[str], rows: list[list], right: AbstractSet[int] = frozenset()) -> str:
    """A plain text table; columns in ``right`` are right-aligned."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else printable(str(c)) for c in r]
                                           for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = line(["-" * w for w in widths])
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def guard(what: str, fn, *args, **kwargs):
    """Run a pipeline; an unexpected exception (a bug) becomes an ``InternalError`` (exit 3)."""
    try:
        return fn(*args, **kwargs)
    except (H3QuantError, OSError, MemoryError, KeyboardInterrupt, RecursionError):
        raise
    except Exception as exc:
        from h3quant.cli.os_errors import is_out_of_memory

        if is_out_of_memory(exc):  # PyTorch's allocator refusing: memory, not a bug
            raise MemoryError(str(exc)) from None
        if debug_enabled():
            raise
        raise InternalError(exc, what) from None


# -- option types shared by every command: bad values are usage errors (exit 2), before work --
class _Finite(click.ParamType):
    name = "number"

    def __init__(self, lo: float | None = None, hi: float | None = None):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        import math

        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if (self.lo is not None and x < self.lo) or (self.hi is not None and x > self.hi):
            self.fail(f"{x:g} is outside [{self.lo:g}, {self.hi:g}]", param, ctx)
        return x


def finite_float(lo: float | None = None, hi: float | None = None) -> click.ParamType:
    return _Finite(lo, hi)


class _Checkpoint(click.Path):
    """A checkpoint argument: a path, or ``ORG/NAME[@REV][:SUBFOLDER]`` read from the local
    Hugging Face cache (``sources.hf``; never downloaded)."""

    def __init__(self, path_type: type = str):
        super().__init__(dir_okay=True, path_type=path_type)

    def convert(self, value, param, ctx):
        from h3quant.sources.hf import resolve

        try:
            value = resolve(os.fspath(value))
        except H3QuantError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)


CHECKPOINT = _Checkpoint()
CHECKPOINT_PATH = _Checkpoint(path_type=Path)


# the documented limits (h3quant.limits): H3 has 50 blocks; verify activations are tokens x
# hidden floats per layer; more workers than this gain nothing and cost memory
from h3quant.limits import (  # noqa: E402,F401
    MAX_AUDIO_FRAMES,
    MAX_BLOCKS,
    MAX_MODEL_ROWS,
    MAX_TOKENS,
    MAX_WORKERS,
)

SEED = click.IntRange(0, 2**32 - 1)  # numpy and torch both take it; beyond is an error
WORKERS = click.IntRange(1, MAX_WORKERS)


def check_device(spec: str, *, require_available: bool, parsed: bool = False):
    """Validate a ``--device`` value before any work; raises ``click.BadParameter``. Returns
    ``spec``, or with ``parsed`` the ``Device`` it names (``auto`` resolved), which the
    pipelines take as it is: the string is parsed once."""
    from h3quant.errors import DeviceError
    from h3quant.runtime.devices import parse_device

    from h3quant.runtime.availability import require_device

    try:  # require_device parses too, then asks the machine
        dev = (require_device if require_available else parse_device)(spec)
    except DeviceError as exc:
        raise click.BadParameter(exc.reason, param_hint="'--device'") from None
    return dev if parsed else spec


def device_callback(require_available: bool, *, parsed: bool = False):
    def callback(ctx, param, value):
        if value is None:
            return None
        if not parsed and value == HOST.name:  # the host is always there: torch is not loaded
            return value  # for it (convert starts its copies before torch is imported)
        return check_device(value, require_available=require_available, parsed=parsed)

    return callback


def given_options(ctx, names) -> list[str]:
    """The options among ``names`` (parameter names) the user typed on the command line."""
    from click.core import ParameterSource

    return ["--" + n.replace("_", "-") for n in names
            if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE]


def inputs_from_file(ctx, path, sigma):
    """The whole-model inputs held in --inputs FILE (None without it); options that conflict
    with the file (sizes, seed, another sigma) are usage errors."""
    if path is None:
        return None
    wrong = given_options(ctx, ("frames", "height", "width", "audio_frames", "text_tokens", "seed"))
    if wrong:
        raise click.UsageError(f"{', '.join(wrong)} cannot be used with --inputs (the file "
                               "gives the latents and their sizes)")
    from h3quant.pipelines.verify.model import ModelInputs

    inputs = ModelInputs.from_file(path, sigma)
    if given_options(ctx, ("sigma",)) and inputs.sigma != sigma:
        raise click.UsageError(f"--sigma {sigma:g} conflicts with the sigma {inputs.sigma:g} "
                               f"held in --inputs {path}")
    return inputs
