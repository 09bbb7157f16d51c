"""GGUF files: read through the gguf package (Q8_0 / Q4_0 written by its own writer and
quantizers and decoded by its own dequantize; a Q4_K file written block by block here and
decoded by a decoder written here), ComfyUI's names and shapes, inspect / validate / convert."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers.gguf_files import q4k_decode, q4k_encode, write_gguf
from helpers.h3files import read_tensors as read_all

from h3quant.cli import main
from h3quant.errors import ContainerError
from h3quant.formats.gguf import GgufFile, is_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("gguf")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    tensors, _ = read_all(src)
    return {"dir": d, "src": src, "tensors": tensors}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_package_quants_read_back_as_the_package_decodes_them(tmp_path, qtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((6, 96)) * 0.1).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(a, t)
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "minimax_h3")
    w.add_tensor("model.diffusion_model.blocks.0.mlp.fc2.weight", raw, raw_dtype=t)
    w.add_tensor("model.diffusion_model.blocks.0.mlp.fc2.bias", np.arange(6, dtype=np.float32))
    w.add_tensor("text_encoder.dropped", np.zeros(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert is_gguf(p)
    with GgufFile(p) as g:
        # the prefix of a full checkpoint is stripped; tensors outside it are not the model's
        assert sorted(g.tensors) == ["blocks.0.mlp.fc2.bias", "blocks.0.mlp.fc2.weight"]
        info = g.tensors["blocks.0.mlp.fc2.weight"]
        assert (info.qtype, info.shape) == (qtype, (6, 96))
        want = gguf.quants.dequantize(raw, t).reshape(6, 96)
        assert np.array_equal(g.read("blocks.0.mlp.fc2.weight"), want)
        assert np.abs(want - a).max() < (0.01 if qtype == "Q8_0" else 0.1)
        assert np.array_equal(g.read("blocks.0.mlp.fc2.bias"), np.arange(6, dtype=np.float32))
        assert g.architecture == "minimax_h3" and g.version == 3


def test_a_k_quant_written_block_by_block(tmp_path):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    raw = q4k_encode(a)
    assert raw.shape == (4, 2 * 144)
    p = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(p), "minimax_h3")
    w.add_tensor("blocks.0.attn.out_proj.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GgufFile(p) as g:
        got = g.read("blocks.0.attn.out_proj.weight")
        assert g.tensors["blocks.0.attn.out_proj.weight"].bits_per_weight == 4.5
    want = q4k_decode(raw, a.shape)
    assert np.array_equal(got, want)
    assert np.linalg.norm(got - a) / np.linalg.norm(a) < 0.15  # a real quantization of a


def test_forged_files_are_refused(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ContainerError, match="malformed GGUF header"):
        GgufFile(p)
    q = tmp_path / "no.gguf"
    q.write_bytes(b"GGUX" + b"\x00" * 40)
    assert not is_gguf(q)
    with pytest.raises(ContainerError, match="no GGUF magic"):
        GgufFile(q)
    r = CliRunner().invoke(main, ["validate", str(p), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["findings"][0]["code"] == "G101"
    r = CliRunner().invoke(main, ["inspect", str(p)])
    assert r.exit_code == 2 and "malformed GGUF header" in r.output


def test_inspect_validate_and_convert_read_an_h3_gguf(h3, tmp_path):
    f = tmp_path / "h3-Q8_0.gguf"
    write_gguf(h3["tensors"], f, "Q8_0")
    r = CliRunner().invoke(main, ["inspect", str(f), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["container"] == "gguf" and info["types"]["Q8_0"]["tensors"] == 4
    assert info["bits_per_weight"]["block_linears"] == 8.5
    assert info["topology"]["blocks"] == 1 and info["topology"]["hidden"] == 512
    r = CliRunner().invoke(main, ["validate", str(f), "--deep"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "int8.safetensors"
    r = CliRunner().invoke(main, ["convert", str(f), str(out), "--to", "int8-convrot",
                                  "--no-report", "-q"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3-Q8_0.gguf", "int8.safetensors"]
    got, _ = read_all(out)
    # the converted layer encodes the GGUF's own dequantized values (not the original BF16)
    from h3quant.formats.int8.tensors import decode_int8

    name = "blocks.0.mlp.fc1"
    with GgufFile(f) as g:
        src = torch.from_numpy(g.read(name + ".weight"))
    dec = decode_int8(got[name + ".weight"], got[name + ".weight_scale"], convrot=True)
    assert (dec - src).norm() / src.norm() < 0.02
    r = CliRunner().invoke(main, ["convert", str(f), str(f)])
    assert r.exit_code == 2 and f.read_bytes()[:4] == b"GGUF"
