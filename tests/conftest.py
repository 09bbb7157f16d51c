"""Fixtures shared by the test modules: synthetic H3 files made once per test run (the tiny
preset, BF16 and quantized) and the default small H3 source of the convert tests.

The helpers these build on are plain functions in tests/helpers/ (importable as ``helpers``:
pytest puts this directory on sys.path because it holds this conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers.h3files import quantize_file, small_h3, write
from helpers.scratch import SESSION_SCRATCH


def pytest_configure(config):
    """A suite started in the background by a script (``cmd &`` without job control, nohup)
    inherits SIGINT ignored, and so would every process it starts: Python keeps an ignored
    SIGINT ignored, so Ctrl-C could not reach the converts the signal tests interrupt. They test
    the process a user starts from a terminal, so SIGINT gets its default handling back here
    (and, through exec, in every child)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the process that prints the run
        config.pluginmanager.register(_RunNotes(config), "h3quant-run-notes")
    _share_the_cores()


def _share_the_cores() -> None:
    """Under ``-n N`` each xdist worker gets its share of the machine's cores for torch's
    intra-op threads (and so does every child it starts, through OMP_NUM_THREADS). Each torch
    otherwise starts one thread per core: N workers then run N times more threads than cores,
    and the threads of a parallel op spin-wait for siblings that are not scheduled (on two
    cores with -n 2, a sensitivity pass took ten times the CPU time). Without -n nothing
    changes."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


SCRATCH_PEAK_GB = 2.5  # the most the suite holds at a time (measured on a full -n 2 run)


class _RunNotes:
    """What the process that prints the run says beside pytest's own report:

    - at the start, a warning when the temporary directory's disk has less room than the
      suite's peak (the failures a full disk causes part way through name no cause);
    - the first few failures as they happen, with their exception's one-line message, between
      the progress dots: a log cut short after its first lines (a CI page) still shows why the
      run failed. The full tracebacks come at the end as always."""

    EARLY_FAILURES = 5

    def __init__(self, config):
        self.config, self.named = config, 0

    def _say(self, text: str, **markup) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(text, **markup)

    def pytest_sessionstart(self, session):
        import tempfile

        where = session.config.option.basetemp or tempfile.gettempdir()
        probe = Path(where)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free / 1e9
        if free < SCRATCH_PEAK_GB * 1.5:
            self._say(f"warning: {free:.1f} GB free under {where}; the suite holds up to about "
                      f"{SCRATCH_PEAK_GB} GB of temporary files at a time (set TMPDIR or "
                      "--basetemp to a disk with more room)", yellow=True)

    def pytest_runtest_logreport(self, report):
        if not report.failed or self.named >= self.EARLY_FAILURES:
            return
        self.named += 1
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0][:300] if crash is not None and crash.message else ""
        self._say(f"\n{report.when} failed: {report.nodeid}: {why}", red=True)


# A directory a session-scoped fixture makes lives until the run ends; every other directory made
# under the run's base temp (tmp_path_factory.mktemp in a module-scoped fixture) is removed when
# its module ends, unless one of the module's tests failed. Per-test tmp_path directories are
# removed when their test passes (tmp_path_retention_policy in pyproject.toml). Without this the
# suite kept about 13 GB of scratch until it ended, more than a CI machine's disk may hold.
_FAILED_MODULES: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _FAILED_MODULES.add(item.module.__name__ if item.module else item.nodeid)
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_scratch_removed(request, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    yield
    if request.module.__name__ in _FAILED_MODULES:
        return
    for name in set(os.listdir(base)) - before:
        if not name.startswith((SESSION_SCRATCH, "test_")):  # test_*: tmp_path, kept if it failed
            shutil.rmtree(base / name, ignore_errors=True)


@pytest.fixture(scope="session")
def tp_files(tmp_path_factory) -> dict[str, Path]:
    """tiny preset, 1 block: BF16 source, int8 ConvRot (canonical and kn layouts) and W4A8,
    converted by ``convert`` (the tensor-parallel, API and loadable-variant tests)."""
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp(SESSION_SCRATCH + "h3q-tp")
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1)
    out = {"dir": d, "bf16": bf16}
    for key, target in (("int8", "int8-convrot"), ("w4a8", "w4a8")):
        out[key] = d / f"{key}.safetensors"
        convert(bf16, out[key], ConvertOptions(target=target, report=False))
    out["kn"] = d / "kn.safetensors"  # the NPU layout: int8 weights stored [K, N]
    convert(out["int8"], out["kn"], ConvertOptions(layout="npu", report=False))
    return out


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """tiny preset, 1 block: BF16 and its int8 ConvRot version quantized by the codecs directly
    (``helpers.h3files.quantize_file``; the loader, block and verify tests)."""
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp(SESSION_SCRATCH + "h3q-verify")
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1)
    return {"dir": d, "bf16": bf16, "int8": quantize_file(bf16, d / "int8.safetensors")}


@pytest.fixture
def src(tmp_path) -> Path:
    """A one-block miniature H3 checkpoint (``helpers.h3files.small_h3``) at tmp_path/in.safetensors;
    modules that need another source define their own ``src``."""
    return write(tmp_path / "in.safetensors", small_h3(blocks=1))
