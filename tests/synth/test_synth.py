"""Synthetic H3 checkpoints: layout, determinism, statistics, read-back, CLI."""

import hashlib
import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from h3quant.cli.synth_cmd import command
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.h3.topology import config_for, expected_tensors
from h3quant.formats.container.writer import Entry
from h3quant.synth import METADATA_KEY, synth_checkpoint, tensor_chunks


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.safetensors"
    return synth_checkpoint(path, preset="tiny", seed=3)


def test_layout_matches_topology(tiny):
    expected = expected_tensors(config_for("tiny"))
    assert tiny.tensors == len(expected)
    assert tiny.nbytes == tiny.path.stat().st_size
    with Checkpoint(tiny.path) as ck:
        got = {n: (i.dtype, i.shape) for n, i in ck.tensors.items()}
        assert got == expected
        meta = json.loads(ck.metadata[METADATA_KEY])
        assert meta["preset"] == "tiny" and meta["seed"] == 3 and meta["form"] == "pruned"
        assert ck.metadata["format"] == "pt"


def test_reads_back_with_safetensors(tiny):
    with Checkpoint(tiny.path) as ck, safe_open(str(tiny.path), "pt") as st:
        assert set(st.keys()) == set(ck.tensors)
        for name in ("blocks.1.mlp.fc1.weight", "adaln_t_table", "rope.inv_freq",
                     "video_patch_proj.weight", "blocks.0.attn.q_norm.weight"):
            a, b = ck.read(name), st.get_tensor(name)
            assert a.dtype == b.dtype and torch.equal(a, b)
            assert torch.isfinite(a.float()).all()


def test_deterministic(tmp_path, tiny):
    again = synth_checkpoint(tmp_path / "a.safetensors", preset="tiny", seed=3, workers=1)
    assert _sha(again.path) == _sha(tiny.path)  # same bytes whatever the thread count
    other = synth_checkpoint(tmp_path / "b.safetensors", preset="tiny", seed=4)
    assert _sha(other.path) != _sha(tiny.path)
    with Checkpoint(tiny.path) as a, Checkpoint(other.path) as b:
        for name in a.tensors:
            if name != "rope.inv_freq":  # the only deterministic formula
                assert not torch.equal(a.read(name), b.read(name)), name


def test_outlier_input_channels(tiny):
    with Checkpoint(tiny.path) as ck:
        for name in ("blocks.0.attn.qkv_proj.weight", "blocks.1.mlp.fc2.weight",
                     "token_refiner.blocks.0.mlp.fc1.weight", "condition_proj.weight"):
            w = ck.read(name).float()
            col = w.norm(dim=0)
            med = col.median()
            assert col.max() > 8 * med, name
            assert 4 <= int((col > 5 * med).sum()) <= 8, name
            rest = w[:, col < 2 * med]
            k = w.shape[1]
            assert abs(rest.std().item() * math.sqrt(k) - 1.0) < 0.05, name  # std 1/sqrt(K)
            assert abs(rest.mean().item()) < 0.01 / math.sqrt(k) * 10
        w = ck.read("blocks.0.adaln_proj.linear.weight").float()
        col = w.norm(dim=0)
        assert col.max() < 1.5 * col.median()  # no outliers outside the chosen linears


def test_norms_biases_and_tables(tiny):
    with Checkpoint(tiny.path) as ck:
        norm = ck.read("blocks.1.norm2.weight").float()
        assert abs(norm.mean().item() - 1.0) < 0.02 and 0.02 < norm.std().item() < 0.08
        bias = ck.read("condition_proj.bias").float()
        assert bias.abs().max() < 0.1 and bias.std() > 0.001
        table = ck.read("adaln_t_table")
        step = (table[1:] - table[:-1]).abs().max()
        assert step < 0.05 * (table.max() - table.min())  # smooth along t
        inv = ck.read("rope.inv_freq")
        assert inv[0] == 1.0 and torch.all(inv[1:] < inv[:-1])


def test_chunking_covers_rows():
    entry = Entry("blocks.0.mlp.fc2.weight", "BF16", (2000, 5376))  # several chunks
    chunks = list(tensor_chunks(entry, seed=0))
    assert len(chunks) > 1
    assert sum(c.shape[0] for c in chunks) == 2000 and all(c.shape[1] == 5376 for c in chunks)
    assert sum(c.nbytes for c in chunks) == entry.nbytes


def test_full_form_tiny(tmp_path):
    res = synth_checkpoint(tmp_path / "f.safetensors", preset="tiny", blocks=1, form="full")
    with Checkpoint(res.path) as ck:
        assert "time_embedder.proj_out.weight" in ck.tensors and "adaln_t_table" not in ck.tensors
        assert ck.tensors["blocks.0.adaln_proj.linear.weight"].shape == (512 * 18, res.config.t_dim)


def test_cli_writes_and_refuses_existing(tmp_path):
    out = tmp_path / "h3.safetensors"
    runner = CliRunner()
    res = runner.invoke(command, [str(out), "--blocks", "1", "--seed", "5"])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.stderr and "blocks=1" in res.stderr and res.stdout == ""
    digest = _sha(out)
    res = runner.invoke(command, [str(out), "--seed", "6"])
    assert res.exit_code == 2 and "--overwrite" in res.stderr
    assert _sha(out) == digest  # untouched
    res = runner.invoke(command, [str(out), "--blocks", "1", "--seed", "6", "--overwrite", "--quiet"])
    assert res.exit_code == 0 and res.stderr == ""
    assert _sha(out) != digest
    res = runner.invoke(command, [str(tmp_path / "no" / "x.safetensors")])
    assert res.exit_code == 2 and "does not exist" in res.stderr
    res = runner.invoke(command, [str(out), "--preset", "huge"])
    assert res.exit_code == 2


def test_cli_help():
    res = CliRunner().invoke(command, ["--help"])
    assert res.exit_code == 0
    for word in ("--preset", "--blocks", "--form", "--seed", "--overwrite", "--quiet", "Examples"):
        assert word in res.output


def test_convrot_benefit_is_measurable(tiny):
    from h3quant.convrot import rotate

    def int8_rowwise(w):
        s = w.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(w / s).clamp(-128, 127) * s

    with Checkpoint(tiny.path) as ck:
        w = ck.read("blocks.0.mlp.fc1.weight").float()
    plain = (int8_rowwise(w) - w).norm() / w.norm()
    rotated = (rotate(int8_rowwise(rotate(w, 256)), 256) - w).norm() / w.norm()
    assert rotated < plain / 3  # outlier columns hurt plain row-wise int8, ConvRot spreads them
