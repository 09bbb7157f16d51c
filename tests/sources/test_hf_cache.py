"""A Hugging Face cache snapshot (``models--ORG--NAME/snapshots/<rev>/...`` whose files are
symbolic links into ``../../blobs/``) reads as a plain directory; symbolic links anywhere else,
or leading out of the repository folder, stay refused with a message that says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.forge import cli

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.synth import synth_checkpoint
from h3quant.synth.layouts import write_layout
from helpers.hf_cache import hf_cache_snapshot


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    comfy = root / "h3.safetensors"
    synth_checkpoint(comfy, preset="tiny", seed=0)
    write_layout(comfy, root / "official", "official")
    return hf_cache_snapshot(root / "official", root / "hub")


def test_snapshot_reads_as_a_plain_directory(snapshot):
    assert all(p.is_symlink() for p in snapshot.iterdir())
    with Checkpoint(snapshot) as ck:
        assert ck.tensors and not [f for f in ck.findings if f.code == "S106"]
    res = cli("inspect", snapshot)
    assert res.exit_code == 0, res.output
    res = cli("validate", snapshot)
    assert res.exit_code == 0, res.output


def test_snapshot_converts(snapshot, tmp_path):
    out = tmp_path / "h3_int8.safetensors"
    res = cli("convert", snapshot, out, "--to", "int8-convrot", "-q")
    assert res.exit_code == 0, res.output
    assert out.is_file() and not out.is_symlink()
    assert all(p.is_symlink() for p in snapshot.iterdir())  # the cache is untouched


def _index(d: Path) -> Path:
    return next(d.glob("*.index.json"))


def test_link_leading_out_of_the_repository_is_refused(snapshot, tmp_path):
    # a copy of the snapshot whose first shard links outside its models--* folder
    snap = hf_cache_snapshot(snapshot, tmp_path / "hub", repo="models--Other--H3")
    shard = sorted(snap.glob("*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with Checkpoint(snap, strict=False) as ck:
        s106 = [f for f in ck.findings if f.code == "S106"]
    assert s106 and "symbolic link" in s106[0].message and "models--Other--H3" in s106[0].message
    res = cli("inspect", snap)
    assert res.exit_code != 0 and "symbolic link" in res.output


def test_link_outside_any_cache_is_refused_naming_links(snapshot, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    for f in snapshot.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    shard = sorted(d.glob("*.safetensors"))[0]
    moved = tmp_path / "moved.safetensors"
    os.replace(shard, moved)
    shard.symlink_to(moved)
    with Checkpoint(_index(d), strict=False) as ck:
        s106 = [f for f in ck.findings if f.code == "S106"]
    assert s106 and "symbolic link" in s106[0].message
    assert "Hugging Face cache" in s106[0].message
    assert json.loads(_index(d).read_text())["weight_map"]
