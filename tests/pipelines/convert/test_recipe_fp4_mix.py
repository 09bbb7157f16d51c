"""A mixed file in one pass: nvfp4 MLP, INT4 ConvRot and int8 ConvRot attention, bf16 edge
blocks; comfy-kitchen reads every layer as its marker says."""

import re

import pytest
import torch

from helpers.forge import cli, validate
from helpers.kitchen_files import kitchen_quantize, read_all
from h3quant.synth import synth_checkpoint

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")

BLOCKS = 4
RULES = [r"blocks\.(0|3)\.=bf16", r"mlp\.=nvfp4", r"attn\.out_proj=int4-convrot",
         r"attn\.=int8-convrot"]
# What each rule means on disk, written out here independently of the product
EXPECT = [None, "nvfp4", "convrot_w4a4", "int8_tensorwise"]


def expected(name):
    for rule, want in zip(RULES, EXPECT):
        if re.search(rule.split("=")[0], name):
            return want
    return "int8_tensorwise"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    src, out = d / "bf16.safetensors", d / "mixed.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=BLOCKS, seed=3)
    res = cli("convert", src, out, "--to", "int8-convrot", "-q",
              *[a for r in RULES for a in ("--layer", r)])
    assert res.exit_code == 0, res.output
    return src, out


def test_kitchen_reads_every_layer_as_its_marker_says(files):
    import json

    from comfy_kitchen.tensor import QuantizedTensor

    src, out = files
    a, b = read_all(src), read_all(out)
    seen = set()
    for i in range(BLOCKS):
        for lin in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            name = f"blocks.{i}.{lin}"
            w = a[name + ".weight"]
            want = expected(name)
            if want is None:
                assert name + ".comfy_quant" not in b and torch.equal(b[name + ".weight"], w)
                seen.add("bf16")
                continue
            marker = json.loads(bytes(b[name + ".comfy_quant"].tolist()))
            assert marker["format"] == want, name
            stored = {k[len(name) + 1:]: v for k, v in b.items()
                      if k.startswith(name + ".") and not k.endswith("comfy_quant")}
            if want == "nvfp4":
                ref = kitchen_quantize(w, "TensorCoreNVFP4Layout")
                layout = ck_tensor.TensorCoreNVFP4Layout
                params = layout.Params(scale=stored["weight_scale_2"], orig_dtype=torch.float32,
                                       orig_shape=tuple(w.shape),
                                       block_scale=stored["weight_scale"])
                deq = QuantizedTensor(stored["weight"], "TensorCoreNVFP4Layout", params).dequantize()
            elif want == "convrot_w4a4":
                g = marker["convrot_groupsize"]
                ref = kitchen_quantize(w, "TensorCoreConvRotW4A4Layout", convrot_groupsize=g)
                params = ck_tensor.TensorCoreConvRotW4A4Layout.Params(
                    scale=stored["weight_scale"], orig_dtype=torch.float32,
                    orig_shape=tuple(w.shape), convrot_groupsize=g)
                deq = QuantizedTensor(stored["weight"], "TensorCoreConvRotW4A4Layout",
                                      params).dequantize()
            else:
                assert marker.get("convrot") is True
                ref = kitchen_quantize(w.float(), "TensorWiseINT8Layout", per_channel=True,
                                       convrot=True, convrot_groupsize=marker["convrot_groupsize"])
                params = ck_tensor.TensorWiseINT8Layout.Params(
                    scale=stored["weight_scale"], orig_dtype=torch.float32,
                    orig_shape=tuple(w.shape), convrot=True,
                    convrot_groupsize=marker["convrot_groupsize"])
                deq = QuantizedTensor(stored["weight"], "TensorWiseINT8Layout", params).dequantize()
            for suffix, v in ref.items():  # the bytes kitchen's quantizer writes
                got = stored[suffix]
                assert got.shape == v.shape and torch.equal(
                    got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (name, suffix)
            rel = ((deq.float() - w.float()).norm() / w.float().norm()).item()
            assert deq.shape == w.shape and rel < 0.25, (name, rel)
            seen.add(want)
    assert seen == {"bf16", "nvfp4", "convrot_w4a4", "int8_tensorwise"}


def test_the_mixed_file_validates_and_inspects(files):
    _, out = files
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0 and not doc["findings"], doc["findings"]
    res = cli("inspect", out, "--layers")
    assert res.exit_code == 0
    for fmt in ("nvfp4", "convrot_w4a4", "int8_tensorwise"):
        assert fmt in res.output


@pytest.mark.slow
def test_plan_measures_the_fp4_candidates(tmp_path):
    import json

    src = tmp_path / "one.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=4)
    res = cli("plan", src, "--formats", "int8-convrot,nvfp4,int4-convrot", "--json", "-q")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    units = {(u["unit"], u["format"]): u for u in doc["sensitivity"]["units"]}
    assert set(units) == {("blocks.0", f) for f in ("int8-convrot", "nvfp4", "int4-convrot")}
    sizes = {f: units[("blocks.0", f)]["bytes"] for f in ("int8-convrot", "nvfp4", "int4-convrot")}
    assert sizes["int4-convrot"] < sizes["nvfp4"] < sizes["int8-convrot"]
    for u in units.values():  # a real measurement: finite, and 4-bit below int8
        assert all(v > 0 for v in u["sqnr_db"].values())
    assert min(units[("blocks.0", "nvfp4")]["sqnr_db"].values()) < \
        min(units[("blocks.0", "int8-convrot")]["sqnr_db"].values())
