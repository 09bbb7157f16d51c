"""A Hugging Face reference stays inside its repository's cache folder (``models--ORG--NAME``):
a ``refs/main`` naming a path outside it, a snapshot folder, a file link or a subfolder link
leading elsewhere are refused naming the link; a snapshot root with no weights names the
subfolder that holds them, a mistyped subfolder lists those that exist; under simulated
Windows an unusable huggingface_hub is reported as such, not as a missing snapshot. The cache
is laid out here as huggingface_hub lays it out (``helpers.hf_cache``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers.forge import cli
from helpers.hf_cache import hf_cache_snapshot
from hostile_util import ENV, ROOT

from h3quant.synth import synth_checkpoint

pytest.importorskip("huggingface_hub")
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def home(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    synth_checkpoint(src / "h3.safetensors", preset="tiny", blocks=1, seed=4, workers=1)
    hf_cache_snapshot(src, tmp_path / "home" / "hub", subfolder="transformer")
    outside = tmp_path / "outside"
    shutil.copytree(src, outside / "transformer")  # readable weights outside the repository
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    repo = tmp_path / "home" / "hub" / "models--MiniMax--H3"
    return {"repo": repo, "snap": repo / "snapshots" / REV, "outside": outside}


def _refused(arg, *words):
    res = cli("inspect", arg)
    assert res.exit_code == 2, res.output
    assert "outside the repository's cache folder" in res.output, res.output
    for w in words:
        assert w in res.output, res.output


def test_the_plain_reference_reads(home):
    assert cli("inspect", "MiniMax/H3:transformer").exit_code == 0


def test_refs_main_naming_a_path_outside_is_refused(home):
    rel = os.path.relpath(home["outside"], home["repo"] / "snapshots")
    (home["repo"] / "refs" / "main").write_text(rel)
    _refused("MiniMax/H3:transformer", "the snapshot")


def test_a_snapshot_folder_linked_elsewhere_is_refused(home):
    shutil.rmtree(home["snap"])
    home["snap"].symlink_to(home["outside"], target_is_directory=True)
    _refused("MiniMax/H3:transformer", "the snapshot")


def test_a_subfolder_linked_elsewhere_is_refused(home):
    shutil.rmtree(home["snap"] / "transformer")
    (home["snap"] / "transformer").symlink_to(home["outside"] / "transformer",
                                             target_is_directory=True)
    _refused("MiniMax/H3:transformer", "the subfolder 'transformer'")


def test_a_file_link_leading_elsewhere_is_refused(home):
    link = home["snap"] / "transformer" / "h3.safetensors"
    link.unlink()
    link.symlink_to(home["outside"] / "transformer" / "h3.safetensors")
    _refused("MiniMax/H3:transformer", "the link 'h3.safetensors'")


def test_the_root_names_the_subfolder_holding_the_weights(home):
    res = cli("inspect", "MiniMax/H3")
    assert res.exit_code == 2 and "MiniMax/H3:transformer" in res.output, res.output
    res = cli("inspect", f"MiniMax/H3@{REV}")
    assert res.exit_code == 2 and f"MiniMax/H3@{REV}:transformer" in res.output, res.output


def test_a_mistyped_subfolder_lists_the_ones_that_exist(home):
    (home["snap"] / "vae").mkdir()
    res = cli("inspect", "MiniMax/H3:transfomer")
    assert res.exit_code == 2 and "'transformer', 'vae'" in res.output, res.output


def test_simulated_windows_reports_the_hub_not_a_missing_snapshot(home):
    res = subprocess.run([sys.executable, "-m", "h3quant.testing.sim_windows", "inspect",
                          "MiniMax/H3:transformer"], capture_output=True, text=True, cwd=ROOT,
                         env={**ENV, "HF_HOME": os.environ["HF_HOME"]}, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode in (0, 2) and "Traceback" not in out, out
    assert "has no snapshot" not in out, out  # the snapshot is there
    if res.returncode == 2:  # the package cannot load under the simulation: said so
        assert "huggingface_hub" in out and "cannot be loaded" in out, out
