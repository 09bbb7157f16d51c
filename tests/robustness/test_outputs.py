"""Output paths: never an input, never each other, never a non-regular file or a foreign
directory; existing only with --overwrite; all outputs of one command appear together or not at
all; stale staging from a killed run is cleaned (``formats.container.atomic``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.h3files import sha, small_h3

from h3quant.cli import main
from h3quant.errors import OutputError
from h3quant.formats.container import platform
from h3quant.formats.container import atomic
from h3quant.pipelines.convert import ConvertOptions, convert


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# --------------------------------------------------------------------- output is an input
def test_report_onto_the_input_is_refused_and_nothing_written(src, tmp_path):
    before = sha(src)
    out = tmp_path / "out.safetensors"
    res = cli("convert", src, out, "--report", src, "--overwrite")
    assert res.exit_code == 2, res.output
    assert "report is the input" in res.output and str(src) in res.output
    assert sha(src) == before and not out.exists()
    assert names(tmp_path) == ["in.safetensors"]


def test_report_through_a_link_or_hard_link_to_the_input_is_refused(src, tmp_path):
    before = sha(src)
    sym, hard = tmp_path / "sym.json", tmp_path / "hard.json"
    sym.symlink_to(src)
    os.link(src, hard)
    for rep in (sym, hard):
        res = cli("convert", src, tmp_path / "o.safetensors", "--report", rep, "--overwrite")
        assert res.exit_code == 2, res.output
        assert str(rep) in res.output
    assert sha(src) == before


def test_output_through_a_symlink_to_the_input_is_refused(src, tmp_path):
    link = tmp_path / "link.safetensors"
    link.symlink_to(src)
    before = sha(src)
    with pytest.raises(OutputError, match="is the input"):
        convert(src, link, ConvertOptions(overwrite=True))
    assert sha(src) == before


def test_output_and_report_must_differ(src, tmp_path):
    out = tmp_path / "o.safetensors"
    res = cli("convert", src, out, "--report", tmp_path / "." / "o.safetensors")
    assert res.exit_code == 2 and "same file" in res.output
    assert names(tmp_path) == ["in.safetensors"]


# ------------------------------------------------------------------ not a regular file
@pytest.mark.parametrize("kind", ["dir", "fifo", "symlink", "devnull"])
def test_output_must_be_a_regular_file(src, tmp_path, kind):
    out = tmp_path / "o.safetensors"
    if kind == "dir":
        out.mkdir()
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "symlink":
        (tmp_path / "target").write_text("keep")
        out.symlink_to(tmp_path / "target")
    else:
        out = Path("/dev/null")
    res = cli("convert", src, out, "--overwrite", "--report", tmp_path / "r.json")
    assert res.exit_code == 2, res.output
    assert str(out) in res.output
    assert not (tmp_path / "r.json").exists()
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "keep"


def test_report_must_be_a_regular_file(src, tmp_path):
    (tmp_path / "rdir").mkdir()
    res = cli("convert", src, tmp_path / "o.safetensors", "--report", tmp_path / "rdir")
    assert res.exit_code == 2 and "rdir" in res.output
    assert not (tmp_path / "o.safetensors").exists()


# ---------------------------------------------------------------------- --overwrite
def test_existing_output_or_report_needs_overwrite(src, tmp_path):
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    rep.write_text("mine")
    res = cli("convert", src, out, "--report", rep)
    assert res.exit_code == 2 and "--overwrite" in res.output and str(rep) in res.output
    assert rep.read_text() == "mine" and not out.exists()
    res = cli("convert", src, out, "--report", rep, "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads(rep.read_text())["output"] == str(out)


def test_synth_refuses_existing_and_non_regular_outputs(tmp_path):
    out = tmp_path / "s.safetensors"
    out.write_text("mine")
    res = cli("synth", out)
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert out.read_text() == "mine"
    (tmp_path / "d").mkdir()
    assert cli("synth", tmp_path / "d", "--overwrite").exit_code == 2
    assert cli("synth", out, "--overwrite", "-q").exit_code == 0
    assert out.stat().st_size > 1000
    assert names(tmp_path) == ["d", "s.safetensors"]


# ------------------------------------------------------------------ all or nothing
def test_report_that_cannot_be_written_leaves_no_output(src, tmp_path, monkeypatch):
    """The report fails at the last moment (after OUT is complete): OUT does not appear."""
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    real = atomic.write_file

    def broken(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("h3quant.pipelines.convert.write_file", broken)
    with pytest.raises(OSError):
        convert(src, out, ConvertOptions(), report_path=rep)
    assert names(tmp_path) == ["in.safetensors"]
    monkeypatch.setattr("h3quant.pipelines.convert.write_file", real)
    convert(src, out, ConvertOptions(), report_path=rep)
    assert names(tmp_path) == ["in.safetensors", "o.safetensors", "r.json"]


def test_commit_rolls_back_earlier_outputs_when_a_later_one_fails(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"old a")
    outs = atomic.Outputs(overwrite=True)
    atomic.write_file(outs.add(a), b"new a")
    atomic.write_file(outs.add(b), b"new b")
    b.mkdir()  # appears after the checks: b's final move must fail
    with pytest.raises(OutputError):
        outs.commit()
    assert a.read_bytes() == b"old a"  # restored
    assert b.is_dir() and not list(b.iterdir())
    assert names(tmp_path) == ["a.bin", "b.bin"]


# -------------------------------------------------------------- atomic no-clobber
def test_output_appearing_during_the_run_is_not_clobbered(src, tmp_path, monkeypatch):
    """The existence check is repeated atomically at the final rename."""
    out = tmp_path / "o.safetensors"
    from h3quant.pipelines.convert import stream

    real = stream.run_plan

    def racing(plan, ckpt, staged, **kw):
        report = real(plan, ckpt, staged, **kw)
        out.write_text("the other run won")
        return report

    monkeypatch.setattr("h3quant.pipelines.convert.run_plan", racing)
    with pytest.raises(OutputError, match="appeared while"):
        convert(src, out, ConvertOptions(report=False))
    assert out.read_text() == "the other run won"
    assert names(tmp_path) == ["in.safetensors", "o.safetensors"]


def test_rename_noreplace_fallback_is_atomic(tmp_path, monkeypatch):
    """Without renameat2 (other libcs, some file systems) the link/mkdir claim still refuses."""
    monkeypatch.setattr(platform, "_renameat2", lambda: None)
    f, d = tmp_path / "f", tmp_path / "d"
    (tmp_path / "s").write_text("new")
    f.write_text("old")
    with pytest.raises(FileExistsError):
        atomic.rename_noreplace(tmp_path / "s", f)
    assert f.read_text() == "old"
    atomic.rename_noreplace(tmp_path / "s", tmp_path / "g")
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "x").write_text("1")
    d.mkdir()
    with pytest.raises(FileExistsError):
        atomic.rename_noreplace(tmp_path / "sd", d)
    atomic.rename_noreplace(tmp_path / "sd", tmp_path / "e")
    assert (tmp_path / "e" / "x").read_text() == "1"


def test_two_threads_racing_for_one_output_one_wins(tmp_path):
    target = tmp_path / "o.bin"
    results = []
    barrier = threading.Barrier(2)

    def one(tag):
        outs = atomic.Outputs()
        atomic.write_file(outs.add(target), tag.encode())
        barrier.wait()
        try:
            outs.commit()
            results.append(("ok", tag))
        except OutputError:
            outs.abort()
            results.append(("refused", tag))

    ts = [threading.Thread(target=one, args=(t,)) for t in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(r[0] for r in results) == ["ok", "refused"]
    winner = next(tag for r, tag in results if r == "ok")
    assert target.read_text() == winner
    assert names(tmp_path) == ["o.bin"]


# ------------------------------------------------------------------ directories
def test_sharded_output_dir_carries_a_manifest_and_only_own_dirs_are_replaced(tmp_path):
    from helpers.h3files import make_sharded

    d = make_sharded(tmp_path / "in", small_h3(blocks=1))
    out = tmp_path / "out"
    convert(d, out, ConvertOptions(report=False))
    listed = atomic.read_manifest(out)
    assert sorted(listed) == sorted(p.name for p in d.iterdir())
    assert atomic.is_own_output_dir(out)
    with pytest.raises(OutputError, match="--overwrite"):
        convert(d, out, ConvertOptions(report=False))
    (out / "model-00001-of-00002.safetensors").unlink()  # no longer what the manifest says
    with pytest.raises(OutputError, match="did not write"):
        convert(d, out, ConvertOptions(overwrite=True, report=False))
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(d, empty, ConvertOptions(report=False))  # an empty directory holds nothing to lose
    assert atomic.is_own_output_dir(empty)


def test_demo_dir_refuses_a_directory_with_user_files(tmp_path):
    (tmp_path / "h3_bf16.safetensors").write_text("my real model")
    res = cli("demo", "--dir", tmp_path)
    assert res.exit_code == 2 and "did not write" in res.output
    assert (tmp_path / "h3_bf16.safetensors").read_text() == "my real model"


# ------------------------------------------------------------------ stale staging
def test_stale_staging_is_removed_live_staging_is_kept(src, tmp_path):
    live = atomic.Outputs()
    live.add(tmp_path / "other.bin")  # holds its lock
    stale = tmp_path / f"{atomic.STAGING_PREFIX}999999-x{atomic.STAGING_SUFFIX}"
    stale.mkdir()
    (stale / "o.safetensors").write_bytes(b"\0" * 4096)
    msgs = []
    convert(src, tmp_path / "o.safetensors", ConvertOptions(report=False), log=msgs.append)
    assert not stale.exists()
    assert any("stale temporary" in m and str(stale) in m for m in msgs)
    assert sum(p.name.startswith(atomic.STAGING_PREFIX) for p in tmp_path.iterdir()) == 1
    live.abort()
    assert names(tmp_path) == ["in.safetensors", "o.safetensors"]


def test_another_runs_stale_cleanup_never_sees_a_staging_directory_before_its_lock(
        tmp_path, monkeypatch):
    """Two runs writing into one directory: the second run's stale clean-up, at the worst
    moment of the first run's staging set-up, must not take the first run's directory."""
    from h3quant.formats.container import atomic

    real, raced = atomic._try_lock, []

    def lock_after_a_cleanup(path):
        if not raced:
            raced.append(path)
            atomic.clean_stale(tmp_path)  # what a concurrent run does when it starts
        return real(path)

    monkeypatch.setattr(atomic, "_try_lock", lock_after_a_cleanup)
    stage = atomic._Stage(tmp_path)
    try:
        assert raced and stage.path.is_dir() and stage.lock_fd is not None
        assert stage.path.name.endswith(atomic.STAGING_SUFFIX)
    finally:
        stage.remove()
