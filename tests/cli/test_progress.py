"""Progress on a terminal for every long phase (validate --deep, per-block verify, the LoRA
survival pass of convert), silenced by -q, never on stdout; convert's time covers the whole run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers.forge import cli

from h3quant.cli import convert_cmd, validate_cmd, verify_cmd
from h3quant.synth import synth_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("progress")
    src = root / "h3.safetensors"
    synth_checkpoint(src, preset="tiny", seed=0)
    out = root / "int8.safetensors"
    assert cli("convert", src, out, "-q").exit_code == 0
    lora = root / "l.safetensors"
    assert cli("synth-lora", lora, "--preset", "tiny", "--blocks", "2").exit_code == 0
    return {"src": src, "int8": out, "lora": lora}


@pytest.fixture
def terminal(monkeypatch):
    """stderr is a terminal (what ``progress_enabled`` asks)."""
    for mod in (convert_cmd, validate_cmd, verify_cmd):
        if hasattr(mod, "progress_enabled"):
            monkeypatch.setattr(mod, "progress_enabled", lambda quiet=False: not quiet)


def test_validate_deep_shows_progress_and_q_silences_it(files, terminal):
    res = cli("validate", files["int8"], "--deep")
    assert res.exit_code == 0 and "deep check" in res.stderr, res.stderr
    res = cli("validate", files["int8"], "--deep", "-q")
    assert res.exit_code == 0 and "deep check" not in res.stderr
    a = cli("validate", files["int8"], "--deep", "--json")
    b = cli("validate", files["int8"], "--deep", "--json", "-q")
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_verify_blocks_shows_progress(files, terminal):
    res = cli("verify", files["int8"], "--reference", files["src"])
    assert res.exit_code == 0 and "blocks:" in res.stderr, res.stderr
    res = cli("verify", files["int8"], "--reference", files["src"], "-q")
    assert res.exit_code == 0 and "blocks:" not in res.stderr


@pytest.mark.slow
def test_lora_survival_pass_is_shown_and_timed(files, terminal, tmp_path, monkeypatch):
    from h3quant.pipelines.convert import survival

    real = survival.measure

    def slow(*args, **kw):  # a survival pass that takes a measurable time
        time.sleep(1.5)
        return real(*args, **kw)

    monkeypatch.setattr(survival, "measure", slow)
    res = cli("convert", files["src"], tmp_path / "o.safetensors", "--lora", files["lora"],
              "--json")
    assert res.exit_code == 0, res.output
    assert "LoRA survival" in res.stderr
    assert json.loads(res.stdout)["elapsed_s"] >= 1.5  # the whole run, survival pass included
