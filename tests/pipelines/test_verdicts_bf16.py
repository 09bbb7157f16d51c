"""comfy-kitchen quantizing bf16 weights to int8 works in bf16 (rotation, row peaks, division by
the scale rounded to bf16): a valid file with another error than the float32 encode's. The fresh
encode behind relative verdicts makes that encode too, byte for byte, and holds each layer,
block and output to the lower of the two encodes' figures, so verify --model does not flag
kitchen's bf16-made file, nor a float32-made one, while a planted defect in it is still caught.
Files: the tiny synthetic H3 (figures say how the code behaves, not how a released H3 looks)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_verdicts import _edit_safetensors, kitchen_file  # noqa: E402

from helpers.cli import SMALL  # noqa: E402

from h3quant.cli import main  # noqa: E402


@pytest.mark.parametrize("dtype,convrot,g,n,k", [
    (torch.bfloat16, True, 256, 96, 512), (torch.bfloat16, True, 256, 300, 768),
    (torch.float16, True, 64, 64, 256), (torch.bfloat16, False, 256, 80, 320)])
def test_the_in_dtype_encode_is_kitchens_from_such_weights(dtype, convrot, g, n, k):
    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor

    from h3quant.formats.int8.tensors import encode_int8, encode_int8_in_dtype

    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.02).to(dtype)
    kw = {"convrot": True, "convrot_groupsize": g} if convrot else {}
    with ck.registry.use_backend("eager"):
        sd = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True,
                                        **kw).state_dict("x.weight")
    q, s = encode_int8_in_dtype(w, convrot=convrot, group_size=g)
    assert torch.equal(q, sd["x.weight"])
    assert torch.equal(s, sd["x.weight_scale"].float().reshape(-1, 1))
    q32, _ = encode_int8(w.float(), convrot=convrot, group_size=g)
    assert not torch.equal(q, q32)  # the arithmetic shows: another encode than float32's


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    out = {}
    for seed, blocks in ((61, 2), (62, 4)):
        d = tmp_path_factory.mktemp(f"bf16-{seed}-{blocks}")
        ref = d / "bf16.safetensors"
        synth_checkpoint(ref, preset="tiny", blocks=blocks, seed=seed, workers=1)
        f = kitchen_file(ref, d / "int8-bf16.safetensors", "int8-convrot", from_float32=False)
        out[seed, blocks] = (ref, f)
    return out


def _verify(*args):
    r = CliRunner().invoke(main, ["verify", *map(str, args), "--json"])
    assert "Traceback" not in r.output
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize("key", [(61, 2), (62, 4)])
def test_kitchens_bf16_made_int8_passes_verify_model(made, key):
    """Seed 61: video 22.09 dB; the float32 fresh encode gave 30.1 dB, a 25.1 dB limit that
    failed the file; the encode kitchen makes from bf16 is the file itself."""
    ref, f = made[key]
    code, doc = _verify(f, "--reference", ref, "--model", *SMALL)
    assert code == 0, doc
    assert "as comfy-kitchen encodes BF16 weights" in doc["expected"]["what"]
    for o in doc["outputs"]:
        assert o["passed"] and o["limit_db"] == pytest.approx(
            doc["expected"]["outputs"][o["name"]] - 5, abs=0.01)
    code, doc = _verify(f, "--reference", ref, "--device", "cpu")
    assert code == 0, doc


def test_a_defect_in_the_bf16_made_file_is_still_flagged(made, tmp_path):
    ref, f = made[61, 2]
    bad, blocks = _edit_safetensors(f, tmp_path / "scaled.safetensors", "scale x1.5",
                                    "int8-convrot")
    code, doc = _verify(bad, "--reference", ref, "--device", "cpu")
    assert code == 1
    assert any(f"blocks.{b}." in x or f"block {b}" in x for x in doc["failures"] for b in blocks)
    code, doc = _verify(bad, "--reference", ref, "--model", *SMALL)
    assert code == 1 and not all(o["passed"] for o in doc["outputs"]), doc["outputs"]


@pytest.fixture(scope="module")
def seed7(tmp_path_factory):
    """Seed 7, one block, and kitchen's int8 of it made both ways: the two files the fresh
    encodes reproduce byte for byte (tests/pipelines/test_verdicts.py)."""
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("seed7")
    ref = d / "bf16.safetensors"
    synth_checkpoint(ref, preset="tiny", blocks=1, seed=7, workers=1)
    return (ref, {"float32": kitchen_file(ref, d / "f32.safetensors", "int8-convrot"),
                  "BF16": kitchen_file(ref, d / "b16.safetensors", "int8-convrot",
                                       from_float32=False)})


def test_each_figure_is_the_lower_of_the_two_encodes(seed7):
    """Seed 7: the bf16-made encode has the larger error on every layer, yet its block SQNR is
    the higher (31.9 dB against 30.0): holding the block to the encode with the larger weight
    error asked 1.8 dB more than either encode alone. Each layer, block and output is held to
    the lower of the two encodes' figures, measured here by verifying each encode's file."""
    from h3quant.pipelines.compare.run import CompareOptions, compare_files
    from h3quant.pipelines.verify.blocks import verify_checkpoint
    from h3quant.pipelines.verify.model import ModelInputs, verify_model

    ref, made = seed7
    inputs = ModelInputs(frames=1, height=4, width=4, audio_frames=2, text_tokens=4)  # SMALL
    alone = {k: verify_checkpoint(f, reference=ref, device="cpu", expected=False)
             for k, f in made.items()}
    model = {k: verify_model(f, reference=ref, device="cpu", inputs=inputs, expected=False)
             for k, f in made.items()}
    err = {k: {(c.name, c.path): c.rel_err for c in r.layers} for k, r in alone.items()}
    blk = {k: r.block_checks[0].sqnr_db for k, r in alone.items()}
    assert all(err["BF16"][n] > err["float32"][n] for n in err["float32"])  # the case
    assert blk["BF16"] > blk["float32"] + 1
    got = verify_checkpoint(made["float32"], reference=ref, device="cpu")
    [b] = got.block_checks
    assert b.limit_db == round(blk["float32"] - 5, 2) and b.expected_by == "float32"
    for c in got.layers:
        worse = max(err, key=lambda k: err[k][c.name, c.path])
        assert c.limit == round(err[worse][c.name, c.path] * 10 ** 0.25, 6), c
        assert c.expected_by == worse == "BF16"
    got = verify_model(made["float32"], reference=ref, device="cpu", inputs=inputs)
    assert got.passed, got.failures
    outs = {k: {o.name: o.sqnr_db for o in r.outputs} for k, r in model.items()}
    for o in got.outputs:
        lower = min(outs, key=lambda k: outs[k][o.name])
        assert o.limit_db == round(outs[lower][o.name] - 5, 2) and o.expected_by == lower
        assert got.expected["by"][o.name] == lower
    assert len({o.expected_by for o in got.outputs}) == 2  # each encode sets some output
    # compare: both files' own figures on one card, each held to the lower of them (the two
    # encodes are these files, byte for byte)
    cards = {c.facts.path: c for c in compare_files(
        list(map(str, made.values())), reference=ref,
        options=CompareOptions(inputs=inputs, device="cpu")).files}
    each = {k: cards[str(f)] for k, f in made.items()}
    for card in each.values():
        assert card.expected["blocks"][0] == min(c.drift[0].local_sqnr_db for c in each.values())
        for k in ("video", "audio"):
            lower = min(each, key=lambda n: each[n].outputs[k].sqnr_db)
            assert card.expected["outputs"][k] == each[lower].outputs[k].sqnr_db
            assert card.expected["by"]["outputs"][k] == lower
        assert not card.flags


def test_lenient_takes_the_lower_figure_names_its_encode_and_skips_non_finite_ones():
    from h3quant.pipelines.fresh_encode import lenient, set_by

    runs = [("float32", {0: 30.0, 1: 20.0, 2: math.inf, 3: 5.0}),
            ("BF16", {0: 31.9, 1: 19.0, 2: 12.0, 3: 5.0})]
    got = lenient(runs)
    assert got == {0: (30.0, "float32"), 1: (19.0, "BF16"), 2: (12.0, "BF16"),
                   3: (5.0, "float32")}  # a tie stays with the first
    assert set_by(got) == "float32 encode: 2, BF16 encode: 2"
    errs = [("float32", {"a": 0.010, "b": math.nan}), ("BF16", {"a": 0.009, "b": 0.02})]
    assert lenient(errs, higher_is_better=False) == {"a": (0.010, "float32"), "b": (0.02, "BF16")}
