"""The CLI run in-process as tests call it: ``run(*args)`` invokes ``h3quant`` with the
arguments as strings and fails the test on a traceback or an internal error."""

from __future__ import annotations

from click.testing import CliRunner

from h3quant.cli import main


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    return res


# the smallest ``verify --model`` / ``compare`` run the verdict tests make: one 4 x 4 latent
# frame, 2 audio frames, 4 text tokens, on the CPU
SMALL = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "2",
         "--text-tokens", "4", "--device", "cpu"]
