"""``ORG/NAME[@REV][:SUBFOLDER]`` names a checkpoint in the local Hugging Face cache.

The cache is laid out here as huggingface_hub lays it out (``models--ORG--NAME/snapshots/<rev>/``,
``refs/main``, content-addressed ``blobs/`` and relative links), under a temporary ``HF_HOME``;
huggingface_hub itself finds the snapshot. Nothing is downloaded (the machine has no network).
Synthetic tiny checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import pytest
from helpers.forge import cli
from helpers.hf_cache import hf_cache_snapshot

from h3quant.synth import synth_checkpoint

REV = "0123456789abcdef0123456789abcdef01234567"  # what helpers.hf_cache writes
REPO = "MiniMax/H3"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfhome")
    src = root / "src"
    src.mkdir()
    synth_checkpoint(src / "h3.safetensors", preset="tiny", blocks=1, seed=4)
    hf_cache_snapshot(src, root / "home" / "hub", subfolder="transformer")
    return root / "home"


@pytest.fixture(autouse=True)
def _cache(home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)


def _snapshot(home: Path) -> Path:
    return home / "hub" / "models--MiniMax--H3" / "snapshots" / REV


def test_repo_with_subfolder_reads_the_snapshot(home):
    res = cli("inspect", f"{REPO}:transformer")
    assert res.exit_code == 0, res.output
    assert str(_snapshot(home) / "transformer") in res.output
    res = cli("validate", f"{REPO}@{REV}:transformer")  # a commit
    assert res.exit_code == 0, res.output
    res = cli("validate", f"{REPO}@main:transformer")  # a branch, through refs/main
    assert res.exit_code == 0, res.output


def test_repo_root_is_the_snapshot_folder(home):
    res = cli("validate", REPO)  # the root holds only the subfolder: no safetensors file there
    assert res.exit_code == 2
    assert f"{_snapshot(home)}" in res.output and "no .safetensors file" in res.output


def test_convert_takes_a_repo(home, tmp_path):
    out = tmp_path / "o"
    res = cli("convert", f"{REPO}:transformer", out, "-q")  # a folder in, a folder out
    assert res.exit_code == 0, res.output
    assert (out / "h3.safetensors").is_file()
    assert all(p.is_symlink() for p in (_snapshot(home) / "transformer").iterdir())


@pytest.mark.parametrize("arg,what", [
    ("MiniMax/H4", "no snapshot of MiniMax/H4"),
    (f"{REPO}@v9:transformer", "no snapshot of MiniMax/H3 at revision 'v9'"),
    (f"{REPO}:audio", "has no 'audio'"),
    (f"{REPO}:../../x", "must be a relative path inside the repository"),
])
def test_missing_repo_revision_or_subfolder_is_a_clear_error(arg, what):
    res = cli("inspect", arg)
    assert res.exit_code == 2, res.output
    assert what in res.output and res.output.startswith("h3quant: error:")
    if "no snapshot" in what:
        assert "never downloads" in res.output


def test_a_missing_file_stays_a_missing_file(tmp_path):
    res = cli("inspect", "nowhere/model.safetensors")
    assert res.exit_code == 2 and "no such file" in res.output
    assert "Hugging Face" not in res.output


def test_without_huggingface_hub_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    res = cli("inspect", f"{REPO}:transformer")
    assert res.exit_code == 2
    assert "h3quant[hf]" in res.output and "huggingface_hub" in res.output


def test_an_existing_path_wins(tmp_path, monkeypatch):
    d = tmp_path / "MiniMax" / "H3"
    d.mkdir(parents=True)
    synth_checkpoint(d / "h3.safetensors", preset="tiny", blocks=1, seed=5)
    monkeypatch.chdir(tmp_path)
    res = cli("inspect", REPO)
    assert res.exit_code == 0, res.output
    assert "snapshots" not in res.output


# every command that reads a checkpoint takes the repository form, in each checkpoint argument
@pytest.mark.parametrize("command,params", [
    ("inspect", ["ckpt"]), ("validate", ["ckpt"]), ("convert", ["src"]), ("plan", ["src"]),
    ("verify", ["ckpt", "reference"]), ("compare", ["files", "reference"]),
    ("capture", ["ckpt", "through"]),
])
def test_every_checkpoint_argument_resolves_repositories(command, params, home, monkeypatch):
    from h3quant.cli import main

    ctx = click.Context(main)
    cmd = main.get_command(ctx, command)
    by_name = {p.name: p for p in cmd.params}
    for name in params:
        value = by_name[name].type.convert(f"{REPO}:transformer", by_name[name], None)
        assert str(value) == str(_snapshot(home) / "transformer"), (command, name)
