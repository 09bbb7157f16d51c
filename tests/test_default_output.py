"""convert without OUT: a clear default name beside IN (the HF cache is never written into),
and an existing file of that name is never replaced."""

from __future__ import annotations

import os

from helpers.forge import cli
from helpers.hf_cache import hf_cache_snapshot

from h3quant.synth import synth_checkpoint
from h3quant.synth_layouts import write_layout


def test_default_output_beside_the_input(tmp_path):
    src = tmp_path / "h3_bf16.safetensors"
    synth_checkpoint(src, preset="tiny", seed=0)
    res = cli("convert", src, "-q")
    assert res.exit_code == 0, res.output
    out = tmp_path / "h3_bf16_int8-convrot.safetensors"
    assert out.is_file()
    before = out.read_bytes()
    res = cli("convert", src, "--to", "w4a8", "-q")
    assert res.exit_code == 0 and (tmp_path / "h3_bf16_w4a8.safetensors").is_file()
    for extra in ((), ("--overwrite",)):  # never replaced, even with --overwrite
        res = cli("convert", src, *extra)
        assert res.exit_code == 2 and "never replaced" in res.stderr, res.output
    assert out.read_bytes() == before


def test_default_output_of_a_cache_snapshot_goes_to_the_current_directory(tmp_path,
                                                                            monkeypatch):
    comfy = tmp_path / "h3.safetensors"
    synth_checkpoint(comfy, preset="tiny", seed=0)
    write_layout(comfy, tmp_path / "official", "official")
    snap = hf_cache_snapshot(tmp_path / "official", tmp_path / "hub")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    res = cli("convert", snap, "-q")
    assert res.exit_code == 0, res.output
    assert os.listdir(work) == ["H3_transformer_int8-convrot.safetensors"]
    assert all(p.is_symlink() for p in snap.iterdir())
