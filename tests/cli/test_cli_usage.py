"""Usage errors: one style (``h3quant: error: ...``), exit 2, before any work; internal errors
exit 3 asking for a bug report; H3QUANT_DEBUG=0 means off; names are printed escaped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.h3files import write

from h3quant.cli import main

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


BAD = [
    (["convert", "{src}", "{out}", "--workers", "0"], "--workers"),
    (["convert", "{src}", "{out}", "--workers", "100000"], "--workers"),
    (["convert", "{src}", "{out}", "--group-size", "2"], "--group-size"),
    (["convert", "{src}", "{out}", "--group-size", "4096"], "--group-size"),
    (["verify", "{src}", "--device", "gpu"], "--device"),
    (["verify", "{src}", "--device", "cuda:99"], "--device"),  # no such device, GPU machine or not
    (["verify", "{src}", "--magnitude-factor", "nan"], "--magnitude-factor"),
    (["verify", "{src}", "--magnitude-factor", "inf"], "--magnitude-factor"),
    (["verify", "{src}", "--seed", str(2**64)], "--seed"),
    (["verify", "{src}", "--tokens", str(10**12)], "--tokens"),
    (["verify", "{src}", "--blocks", "0"], "--blocks"),
    (["backends", "--device", "gpu"], "--device"),
    (["demo", "--blocks", "0"], "--blocks"),
    (["demo", "--device", "gpu"], "--device"),
    (["synth", "{out}", "--blocks", str(10**8)], "--blocks"),
    (["synth", "{out}", "--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("args, flag", BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD])
def test_bad_values_exit_2_in_one_style_before_any_work(src, tmp_path, monkeypatch, args, flag):
    import h3quant.pipelines.convert as conv
    import h3quant.pipelines.verify.blocks as ver

    def no_work(*a, **k):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(conv, "convert", no_work)
    monkeypatch.setattr(ver, "verify_checkpoint", no_work)
    out = tmp_path / "o.safetensors"
    argv = [a.format(src=src, out=out) for a in args]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h3quant: error: "), res.output
    assert flag in lines[0]
    assert not out.exists()


def test_every_help_states_the_exit_codes():
    from h3quant.cli import _COMMANDS

    for name in [None, *_COMMANDS]:
        res = cli(*([name] if name else []), "--help")
        assert res.exit_code == 0
        text = " ".join(res.output.split())
        assert "Exit status" in text and "3" in text and "internal error" in text, name
        if name:
            assert "Exit status:" in text, f"{name} --help lacks its own exit codes"


def test_internal_error_exits_3_and_asks_for_a_bug_report(src, monkeypatch):
    import h3quant.pipelines.headers.inspect as insp

    def bug(*a, **k):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(insp, "inspect_checkpoint", bug)
    for env in ({}, {"H3QUANT_DEBUG": "0"}, {"H3QUANT_DEBUG": "false"}):
        monkeypatch.delenv("H3QUANT_DEBUG", raising=False)
        res = cli("inspect", src, env=env)
        assert res.exit_code == 3, res.output
        assert "internal error" in res.output and "H3QUANT_DEBUG=1" in res.output
        assert "bug" in res.output and "Traceback" not in res.output
    res = cli("inspect", src, env={"H3QUANT_DEBUG": "1"})
    assert isinstance(res.exception, ZeroDivisionError)  # the traceback, for the bug report


def test_control_characters_in_tensor_names_are_escaped(tmp_path):
    import torch

    evil = "blocks.0.x\x1b[2J\x1b]0;pwned\x07\u202e.weight"
    f = write(tmp_path / "e.safetensors", {evil: torch.ones(2, 2)})
    for args in (["inspect", f, "--layers"], ["validate", f, "--deep"]):
        res = cli(*args)
        assert "\x1b" not in res.output and "\x07" not in res.output
        assert "\u202e" not in res.output
    res = cli("inspect", f, "--layers")
    assert "\\x1b[2J" in res.output


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal(src, tmp_path):
    res = subprocess.run([sys.executable, "-m", "h3quant", "convert", str(src),
                          str(tmp_path / "o.safetensors")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr and "it/s" not in res.stderr and "B/s]" not in res.stderr


@pytest.mark.slow
def test_verify_model_has_no_progress_bar_on_a_pipe(tmp_path):
    ckpt = tmp_path / "h3.safetensors"
    made = subprocess.run([sys.executable, "-m", "h3quant", "synth", str(ckpt), "--blocks", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert made.returncode == 0, made.stderr
    q = tmp_path / "int8.safetensors"
    made = subprocess.run([sys.executable, "-m", "h3quant", "convert", str(ckpt), str(q),
                           "--to", "int8-convrot"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    res = subprocess.run([sys.executable, "-m", "h3quant", "verify", str(q), "--model"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\r" not in res.stderr and "block/s" not in res.stderr
