"""verify --reference on a file whose layers store W diag(s) (convert --smooth): the layer rows
are shown and marked 'smoothed', the block checks judge them; without the header's word for it
the same layers fail, so the marking is what changes the verdict, nothing else."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.h3files import read_tensors

from h3quant.formats.container.writer import save_tensors

from h3quant.calibration import smooth
from h3quant.cli import main
from h3quant.h3.provenance import SMOOTHING_KEY
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.synth import synth_checkpoint

LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify-smoothed")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=7)
    tensors, meta = read_tensors(src)
    g = torch.Generator().manual_seed(3)
    block = {k[len("blocks.0."):]: v for k, v in tensors.items() if k.startswith("blocks.0.")}
    # factors 2^-1 .. 2^1: each layer alone is then far from its float layer, while the block
    # stays within the margin of the lower of the two fresh encodes (float32's and the bf16
    # one comfy-kitchen makes from these weights)
    factors = {lin: torch.pow(2.0, torch.randint(-1, 2, (block[f"{lin}.weight"].shape[1],),
                                                 generator=g).float()) for lin in LINEARS}
    changed = smooth.fold_block(block, factors)
    tensors.update({"blocks.0." + k: v for k, v in changed.items()})
    folded = d / "folded.safetensors"
    save_tensors(folded, tensors, meta)
    q = d / "q.safetensors"
    convert(folded, q, ConvertOptions(target="int8-convrot", report=False))
    qt, qmeta = read_tensors(q)
    marked = d / "marked.safetensors"
    save_tensors(marked, qt, {**qmeta, SMOOTHING_KEY: json.dumps(
        sorted(f"blocks.0.{lin}" for lin in LINEARS))})
    return {"src": src, "plain": q, "marked": marked}


def _verify(path, ref):
    res = CliRunner().invoke(main, ["verify", str(path), "--reference", str(ref), "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def test_smoothed_layers_are_judged_by_their_block(files):
    code, doc = _verify(files["marked"], files["src"])
    assert code == 0, doc
    assert doc["layers"] and all(c["smoothed"] for c in doc["layers"])
    assert any(c["rel_err"] > c["limit"] for c in doc["layers"])  # alone: not the float layer
    assert all(b["passed"] for b in doc["block_checks"])
    assert any(SMOOTHING_KEY in n for n in doc["notes"])


def test_without_the_header_key_the_same_layers_fail(files):
    code, doc = _verify(files["plain"], files["src"])
    assert code == 1
    assert not any(c["smoothed"] for c in doc["layers"])
    assert any(not c["passed"] for c in doc["layers"])
    assert all(b["passed"] for b in doc["block_checks"])
