"""Fault injection on outputs: SIGKILL during an --overwrite, signals during the final move and
while torch loads. Each child run is a real ``h3quant`` process with a delay injected at one
moment; the test kills or signals it there and checks what is left on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.h3files import sha, small_h3, write

from h3quant.formats.container import atomic

pytestmark = pytest.mark.slow  # processes / tensor-parallel ranks: the slow subset

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def h3q(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def staging(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if p.name.startswith(atomic.STAGING_PREFIX)]


# A child convert whose final move stops at one moment (``phase``): it writes ``flag`` and
# sleeps there, so the test can kill or signal it at exactly that point.
CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from h3quant.formats.container import atomic
    phase, flag, *argv = sys.argv[1:]
    def stop_here():
        Path(flag).write_text(phase)
        time.sleep(float(os.environ.get("STOP_S", "30")))
    if phase == "before-new-placed":          # the previous output already moved aside
        real = atomic.rename_noreplace
        def slow(src, dst):
            stop_here()
            return real(src, dst)
        atomic.rename_noreplace = slow
    elif phase == "before-report-placed":     # OUT is in place, the report not yet
        real = atomic.rename_noreplace
        def slow(src, dst):
            if Path(dst).name.endswith(".json"):
                stop_here()
            return real(src, dst)
        atomic.rename_noreplace = slow
    elif phase == "after-commit":             # every output in place, the command not ended
        real = atomic.Outputs.commit
        def slow(self):
            real(self)
            stop_here()
        atomic.Outputs.commit = slow
    from h3quant.cli import run
    run(argv)
""")


def start(phase: str, tmp_path: Path, *argv, stop_s: float = 30):
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, phase, str(flag), *map(str, argv)],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**ENV, "STOP_S": str(stop_s)})
    deadline = time.monotonic() + 150
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        assert time.monotonic() < deadline, "the child never reached the injected moment"
        time.sleep(0.05)
    flag.unlink()
    return proc


def finish(proc, timeout=60):
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def _sharded_input(tmp_path: Path) -> Path:
    from helpers.h3files import make_sharded

    return next(make_sharded(tmp_path / "ck", small_h3(blocks=1)).glob("*.index.json"))


# ------------------------------------------------------------- SIGKILL during --overwrite
def test_sigkill_while_the_old_output_dir_is_moved_aside_never_loses_it(tmp_path):
    """The previous sharded output is moved aside when --overwrite replaces it. SIGKILL at that
    moment (OOM killer) and then any later run writing there must give it back, not delete it
    with the stale staging directory."""
    src = _sharded_input(tmp_path)
    out = tmp_path / "out"
    res = h3q("convert", src, out, "--quiet")
    assert res.returncode == 0, res.stderr
    before = sha(out)

    proc = start("before-new-placed", tmp_path, "convert", src, out, "--overwrite", "--quiet",
                 "--to", "bf16")
    proc.kill()
    proc.wait()
    # The previous output is kept somewhere (here: inside the staging directory) ...
    assert staging(tmp_path)
    # ... and a later run writing beside it (another output entirely) puts it back.
    res = h3q("convert", src, tmp_path / "other", "--no-report")
    assert res.returncode == 0, res.stderr
    assert "restored" in res.stderr and str(out) in res.stderr, res.stderr
    assert out.is_dir() and sha(out) == before
    assert not staging(tmp_path)
    assert names(tmp_path) == ["ck", "other", "out"]


def test_stale_cleanup_keeps_a_previous_output_whose_place_is_taken(tmp_path):
    """If the name has meanwhile been taken by something else, the moved-aside output is kept
    (with its staging directory) and the user is told where: never deleted."""
    src = _sharded_input(tmp_path)
    out = tmp_path / "out"
    assert h3q("convert", src, out, "--quiet").returncode == 0
    before = sha(out)
    proc = start("before-new-placed", tmp_path, "convert", src, out, "--overwrite", "--quiet")
    proc.kill()
    proc.wait()
    out.mkdir()
    (out / "mine.txt").write_text("the user made this")
    msgs: list[str] = []
    atomic.clean_stale(tmp_path, msgs.append)
    kept = [s / atomic.OLD_DIR / "out" for s in staging(tmp_path) if (s / atomic.OLD_DIR / "out").is_dir()]
    assert len(kept) == 1 and sha(kept[0]) == before
    assert any("kept" in m and "out" in m for m in msgs), msgs
    atomic.clean_stale(tmp_path)  # and again: still kept
    assert kept[0].is_dir() and sha(kept[0]) == before


def test_sigkill_between_out_and_report_is_rolled_back_by_the_next_run(tmp_path):
    """OUT and its report appear together or not at all, even across SIGKILL: a run killed
    after OUT moved but before the report did is undone by the next run writing there, which
    then succeeds (its OUT is not 'already there')."""
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    proc = start("before-report-placed", tmp_path, "convert", src, out, "--report", rep,
                 "--quiet")
    proc.kill()
    proc.wait()
    assert out.exists() and not rep.exists()  # what SIGKILL leaves for a moment
    res = h3q("convert", src, out, "--report", rep, "--quiet")
    assert res.returncode == 0, res.stderr
    assert out.exists() and rep.exists()
    assert names(tmp_path) == ["in.safetensors", "o.safetensors", "r.json"]


def test_sigkill_during_an_overwrite_of_a_file_pair_restores_both(tmp_path):
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    assert h3q("convert", src, out, "--report", rep, "--quiet").returncode == 0
    old_out, old_rep = sha(out), rep.read_bytes()
    # without --overwrite of the report pair the final move is a plain rename: use a report
    # name that does not exist yet, so the child stops before placing it
    rep2 = tmp_path / "r2.json"
    proc = start("before-report-placed", tmp_path, "convert", src, out, "--report", rep2,
                 "--overwrite", "--to", "bf16", "--quiet")
    proc.kill()
    proc.wait()
    atomic.clean_stale(tmp_path)
    assert sha(out) == old_out and rep.read_bytes() == old_rep and not rep2.exists()
    assert names(tmp_path) == ["in.safetensors", "o.safetensors", "r.json"]


# ------------------------------------------------------------- SIGTERM / SIGHUP at the end
@pytest.mark.parametrize("phase", ["before-report-placed", "after-commit"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_the_final_move_gives_both_outputs_or_neither(tmp_path, phase, sig):
    """Whatever moment of the final move a signal hits: OUT and the report are both there and
    the exit status is 0, or neither is and it is 128 + N; the message says which."""
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    proc = start(phase, tmp_path, "convert", src, out, "--report", rep, stop_s=3)
    proc.send_signal(sig)
    code, err = finish(proc)
    assert "Traceback" not in err, err
    assert out.exists() == rep.exists(), (names(tmp_path), err)
    if out.exists():
        assert code == 0, err
        assert "nothing written" not in err
    else:
        assert code == 128 + sig and "nothing written" in err
    assert not staging(tmp_path)


# ------------------------------------------------------------- signals while torch loads
TORCH_LOAD_CHILD = textwrap.dedent("""
    import os, signal, sys
    # Deliver SIGTERM at the moment torch's C extension imports numpy during its own
    # initialisation: a Python exception raised there is swallowed by the extension.
    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" and "torch" in sys.modules and not getattr(self, "done", 0):
                self.done = 1
                os.kill(os.getpid(), int(os.environ["SIG"]))
            return None
    sys.meta_path.insert(0, Hook())
    # convert's copy thread checks copied floats with numpy while torch loads in the main
    # thread; it would import numpy first, and torch's initialisation would then find it
    # loaded. The check waits for torch's own import of numpy here (20 s at most), so the
    # signal lands inside torch's initialisation as on a machine where torch wins the race.
    import time
    import h3quant.pipelines.convert.io as cio
    _check = cio.nonfinite
    def _after_torch(*a, **k):
        t0 = time.monotonic()
        while "numpy" not in sys.modules and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        return _check(*a, **k)
    cio.nonfinite = _after_torch
    from h3quant.cli import run
    run(sys.argv[1:])
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_torch_loads_is_not_ignored(tmp_path, sig):
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out = tmp_path / "o.safetensors"
    res = subprocess.run([sys.executable, "-c", TORCH_LOAD_CHILD, "convert", str(src), str(out),
                          "--quiet", "--workers", "1"], capture_output=True, text=True,
                         timeout=180, cwd=ROOT, env={**ENV, "SIG": str(int(sig))})
    assert res.returncode == (130 if sig == signal.SIGINT else 128 + sig), res.stderr
    assert "nothing written" in res.stderr and "Traceback" not in res.stderr
    assert names(tmp_path) == ["in.safetensors"]


# ------------------------------------------------------------- every legal name
def test_outputs_with_the_longest_legal_names_and_odd_characters(tmp_path):
    """An OUT and a report of 255 bytes (NAME_MAX), and names with spaces, quotes or a leading
    dash, are written like any other (the temporaries beside them must fit too)."""
    from h3quant.pipelines.convert import ConvertOptions, convert

    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out = tmp_path / ("a" * 243 + ".safetensors")
    rep = tmp_path / ("r" * 250 + ".json")
    convert(src, out, ConvertOptions(), report_path=rep)
    assert out.stat().st_size > 0 and rep.stat().st_size > 0
    odd = tmp_path / "-x y$'z\"\u00e9.safetensors"
    convert(src, odd, ConvertOptions(report=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.safetensors", out.name, rep.name, odd.name])


# ------------------------------------------------------------- the same rules for every file
def _fake_pyplot(monkeypatch):
    """A stand-in for matplotlib's pyplot (not a dependency): ``savefig`` writes fixed bytes."""
    from unittest import mock

    from h3quant.cli import verify_view

    def savefig(target, **kw):
        data = b"\x89PNG fake"
        if hasattr(target, "write"):
            target.write(data)
        else:
            Path(target).write_bytes(data)

    fig, ax = mock.MagicMock(), mock.MagicMock()
    fig.savefig.side_effect = savefig
    plt = mock.MagicMock()
    plt.subplots.return_value = (fig, ax)
    monkeypatch.setattr(verify_view, "require_matplotlib", lambda: plt)


def cli(*args):
    from click.testing import CliRunner

    from h3quant.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from h3quant.synth import synth_checkpoint

    from h3quant.pipelines.convert import ConvertOptions, convert

    bf16 = tmp_path_factory.mktemp("tiny") / "h3_bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1, seed=3)
    path = bf16.with_name("h3.safetensors")
    convert(bf16, path, ConvertOptions(report=False))
    return path


def test_plot_onto_the_checkpoint_it_verifies_is_refused(tiny, monkeypatch):
    _fake_pyplot(monkeypatch)
    before = sha(tiny)
    res = cli("verify", tiny, "--model", "--depth", "1", "--plot", tiny, "--device", "cpu")
    assert res.exit_code == 2, res.output
    assert "is the input" in res.output
    assert sha(tiny) == before


def test_plot_onto_a_fifo_or_an_existing_file_is_refused(tiny, tmp_path, monkeypatch):
    _fake_pyplot(monkeypatch)
    fifo = tmp_path / "drift.png"
    os.mkfifo(fifo)
    res = cli("verify", tiny, "--model", "--depth", "1", "--plot", fifo, "--device", "cpu")
    assert res.exit_code == 2 and "not a regular file" in res.output, res.output
    import stat as st

    assert st.S_ISFIFO(os.lstat(fifo).st_mode)
    png = tmp_path / "old.png"
    png.write_bytes(b"mine")
    res = cli("verify", tiny, "--model", "--depth", "1", "--plot", png, "--device", "cpu")
    assert res.exit_code == 2 and "--overwrite" in res.output, res.output
    assert png.read_bytes() == b"mine"


def test_plot_with_overwrite_is_written_atomically(tiny, tmp_path, monkeypatch):
    _fake_pyplot(monkeypatch)
    png = tmp_path / "old.png"
    png.write_bytes(b"mine")
    res = cli("verify", tiny, "--model", "--depth", "1", "--plot", png, "--overwrite",
              "--device", "cpu")
    assert res.exit_code in (0, 1), res.output
    assert png.read_bytes() == b"\x89PNG fake"
    assert names(tmp_path) == ["old.png"]


def test_outputs_inside_an_input_directory_are_refused(tmp_path, monkeypatch):
    """A sharded input's directory holds its shards: no output of any command goes in there
    (it would become an unindexed shard, or be read as one)."""
    src = _sharded_input(tmp_path)
    before = sha(src.parent)
    res = cli("convert", src, src.parent / "out.safetensors")
    assert res.exit_code == 2 and "inside the input directory" in res.output, res.output
    res = cli("convert", src, tmp_path / "o", "--report", src.parent / "r.json")
    assert res.exit_code == 2 and "inside the input directory" in res.output, res.output
    res = cli("convert", src.parent, tmp_path / "o2", "--report", src.parent / "r.json")
    assert res.exit_code == 2 and "inside the input directory" in res.output, res.output
    _fake_pyplot(monkeypatch)
    res = cli("verify", src.parent, "--model", "--plot", src.parent / "d.png", "--device", "cpu")
    assert res.exit_code == 2 and "inside the input directory" in res.output, res.output
    assert sha(src.parent) == before
    assert names(tmp_path) == ["ck"]
