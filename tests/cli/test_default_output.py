"""convert without OUT: a clear default name beside IN (the HF cache is never written into),
and an existing file of that name is never replaced."""

from __future__ import annotations

import os

from helpers.forge import cli
from helpers.hf_cache import hf_cache_snapshot

from h3quant.synth import synth_checkpoint
from h3quant.synth.layouts import write_layout


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


def test_default_output_drops_the_inputs_extension(tmp_path):
    """A GGUF input's name loses its extension as a safetensors one does:
    h3-Q4_K.gguf -> h3-Q4_K_int8-convrot.safetensors, not h3-Q4_K.gguf_int8-convrot..."""
    import pytest

    pytest.importorskip("gguf")
    from helpers.gguf_files import write_gguf
    from helpers.h3files import read_tensors

    src = tmp_path / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    gguf_in = tmp_path / "h3-Q8_0.gguf"
    write_gguf(read_tensors(src)[0], gguf_in, "Q8_0")
    res = cli("convert", gguf_in, "-q", "--no-report")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "h3-Q8_0_int8-convrot.safetensors").is_file(), os.listdir(tmp_path)
    folder = tmp_path / "h3.v2"  # a folder's name is kept whole, dots and all
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(src.read_bytes())
    res = cli("convert", folder, "--to", "bf16", "-q", "--no-report")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "h3.v2_bf16.safetensors").exists(), os.listdir(tmp_path)
