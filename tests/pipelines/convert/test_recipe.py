"""Per-layer recipes: parsing, the checks before any work, and a mixed file read by comfy-kitchen."""

import json
import re

import pytest
import torch
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.errors import ConvertError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.formats.markers import parse_header_metadata, parse_marker_bytes
from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
from h3quant.pipelines.convert.recipe import load_recipe, parse_rule, rules_from_data
from h3quant.pipelines.headers.inspect import inspect_checkpoint
from h3quant.synth import synth_checkpoint

BLOCKS = 6
RULES = [r"blocks\.(0|5)\.=int8-convrot", r"attn\.out_proj=int8", r"blocks\.3\.=keep",
         r"mlp\.fc2=int8-convrot:g=64", r"blocks\.=w4a8"]
# What each rule's FORMAT means on disk (written out here, independently of the product):
# (marker format, convrot, convrot group size) or None for a float layer.
EXPECT = [("int8_tensorwise", True, 256), ("int8_tensorwise", False, None), None,
          ("int8_tensorwise", True, 64), ("asym_w4a8_int8", True, 256)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("recipe") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=BLOCKS, seed=11)
    return p


@pytest.fixture(scope="module")
def mixed(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "mixed.safetensors"
    res = CliRunner().invoke(main, ["convert", str(src), str(out), "--to", "int8", "-q"]
                             + [a for r in RULES for a in ("--layer", r)])
    assert res.exit_code == 0, res.output
    return out


def expected_for(name: str):
    for rule, want in zip(RULES, EXPECT):
        pattern = rule.split("=")[0]
        if re.search(pattern, name):
            return want
    return ("int8_tensorwise", False, None)  # --to int8


def block_linears():
    return [f"blocks.{i}.{lin}" for i in range(BLOCKS)
            for lin in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]


# ------------------------------------------------------------------------------------ parsing
def test_rule_parsing():
    r = parse_rule(r"blocks\.0\.=int8-convrot:g=64")
    assert (r.pattern, r.target, r.group_size, r.layout) == (r"blocks\.0\.", "int8-convrot", 64, None)
    r = parse_rule("a=b=w4a8")  # '=' inside the pattern: the format starts at a format name
    assert (r.pattern, r.target) == ("a=b", "w4a8")
    assert parse_rule("x=keep").target is None
    assert parse_rule("x=int8:layout=npu").layout == "npu"
    for bad, why in (("blocks", "REGEX=FORMAT"), ("x=int4", "REGEX=FORMAT"),
                     ("x=int8-convrot:g=32", "power of 4"), ("x=keep:g=64", "no options"),
                     ("x=w4a8:layout=npu", "not available"), ("(=w4a8", "regular expression"),
                     ("x=int8:g=64", "no rotation"), ("x=int8-convrot:h=1", "unknown format option"),
                     ("=w4a8", "non-empty")):
        with pytest.raises(ConvertError, match=re.escape(why)):
            parse_rule(bad)


def test_recipe_file_parsing(tmp_path):
    rules = rules_from_data({"rules": [{"layer": "a", "format": "int8-convrot", "g": 64},
                                       {"layer": "b", "format": "keep"}], "note": "free"}, "r")
    assert [r.text for r in rules] == ["a=int8-convrot:g=64", "b=keep"]
    assert rules_from_data([{"layer": "a", "format": "w4a8"}], "r")[0].target == "w4a8"
    for data, why in (({}, '"rules"'), ({"rules": []}, "non-empty"), ([1], "must be an object"),
                      ([{"layer": "a"}], '"layer" and "format"'),
                      ([{"layer": "a", "format": "w4a8", "bits": 4}], "unknown key"),
                      ([{"layer": "a", "format": "int8-convrot:g=64", "g": 16}], "given twice")):
        with pytest.raises(ConvertError, match=re.escape(why)):
            rules_from_data(data, "r")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConvertError, match="not valid JSON"):
        load_recipe(bad)
    with pytest.raises(ConvertError, match="cannot read recipe"):
        load_recipe(tmp_path / "missing.json")


# ---------------------------------------------------------------------------- the mixed file
@pytest.mark.slow
def test_every_layer_has_its_rules_marker_and_the_header_matches(mixed):
    with Checkpoint(mixed) as ck:
        header = parse_header_metadata(ck.metadata)
        for name in block_linears():
            want = expected_for(name)
            if want is None:
                assert ck.tensors[name + ".weight"].dtype == "BF16", name
                assert name + ".comfy_quant" not in ck.tensors and name not in header
                continue
            marker = parse_marker_bytes(bytes(ck.read_bytes(name + ".comfy_quant")))
            assert header[name] == marker, name
            fmt, convrot, g = want
            assert marker["format"] == fmt, name
            if fmt == "int8_tensorwise":
                assert bool(marker.get("convrot")) == convrot, name
                if convrot:
                    assert marker["convrot_groupsize"] == g, name
            else:
                assert marker["convrot_groupsize"] == g
        assert not scan_checkpoint(ck).findings
        options = json.loads(ck.metadata["h3quant.options"])
        assert options["layers"] == RULES and options["target"] == "int8"


@pytest.mark.slow
def test_comfy_kitchen_dequantizes_every_layer_as_its_marker_says(src, mixed):
    """Each layer is rebuilt with kitchen's layout class for its marker's format and the
    marker's parameters; kitchen's dequantization is close to the source weight (within the
    format's error) and, for int8, equal to quantizing the source itself."""
    ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout

    seen = set()
    with Checkpoint(src) as a, Checkpoint(mixed) as b:
        for name in block_linears():
            w = a.read(name + ".weight").float()
            if name + ".comfy_quant" not in b.tensors:
                assert torch.equal(b.read(name + ".weight").float(), w)
                seen.add("bf16")
                continue
            m = parse_marker_bytes(bytes(b.read_bytes(name + ".comfy_quant")))
            if m["format"] == "int8_tensorwise":
                q, s = b.read(name + ".weight"), b.read(name + ".weight_scale")
                params = TensorWiseINT8Layout.Params(
                    scale=s, orig_dtype=torch.float32, orig_shape=tuple(q.shape),
                    convrot=bool(m.get("convrot")), convrot_groupsize=m.get("convrot_groupsize", 256))
                deq = ck_tensor.QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize()
                ref = ck_tensor.QuantizedTensor.from_float(
                    w, "TensorWiseINT8Layout", per_channel=True, convrot=bool(m.get("convrot")),
                    convrot_groupsize=m.get("convrot_groupsize", 256))
                assert torch.equal(ref._qdata, q), name
                torch.testing.assert_close(deq.float(), ref.dequantize().float(), rtol=0, atol=0)
                limit = 0.02 if m.get("convrot") else 0.05  # outlier columns without rotation
                seen.add(("int8", bool(m.get("convrot")), m.get("convrot_groupsize")))
            else:
                t = {k: b.read(f"{name}.{k}") for k in ("weight", "weight_s_rel",
                                                        "weight_s_channel", "weight_codebook")}
                n, k2 = t["weight"].shape
                params = AsymW4A8Int8Layout.Params(
                    scale=t["weight_s_rel"], orig_dtype=torch.float32, orig_shape=(n, 2 * k2),
                    s_channel=t["weight_s_channel"], codebook=t["weight_codebook"],
                    group_size=m["group_size"], convrot_groupsize=m["convrot_groupsize"])
                deq = ck_tensor.QuantizedTensor(t["weight"], "AsymW4A8Int8Layout",
                                                params).dequantize()
                limit = 0.15
                seen.add("w4a8")
            rel = ((deq.float() - w).norm() / w.norm()).item()
            assert deq.shape == w.shape and rel < limit, (name, rel)
    assert seen == {"bf16", "w4a8", ("int8", True, 256), ("int8", True, 64), ("int8", False, None)}


@pytest.mark.slow
def test_recipe_file_gives_the_same_bytes_as_the_flags(src, mixed, tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"rules": [
        {"layer": r.split("=")[0], "format": r.split("=", 1)[1]} for r in RULES]}))
    out = tmp_path / "from_recipe.safetensors"
    res = CliRunner().invoke(main, ["convert", str(src), str(out), "--to", "int8", "-q",
                                    "--recipe", str(recipe)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == mixed.read_bytes()


def test_inspect_shows_the_mix(mixed):
    mix = inspect_checkpoint(mixed).mix
    rows = {r["blocks"]: r["layers"] for r in mix if "blocks" in r}
    assert set(rows) == {"0", "1-2", "3", "4", "5"}
    assert rows["3"]["mlp.fc1"] == "BF16"
    assert rows["1-2"]["mlp.fc2"] == "int8_tensorwise convrot g=64"
    assert rows["1-2"]["attn.out_proj"] == "int8_tensorwise"
    assert rows["4"]["mlp.fc1"].startswith("asym_w4a8_int8")
    res = CliRunner().invoke(main, ["inspect", str(mixed)])
    assert "per-layer formats" in res.output and "blocks 1-2" in res.output


def test_one_format_file_has_no_mix(src):
    assert inspect_checkpoint(src).mix is None


# ------------------------------------------------------------------------ checks before work
@pytest.mark.parametrize("rules, why", [
    ([r"head\.=w4a8"], "names no layer"),
    ([r"blocks\.0\.=w4a8", r"blocks\.0\.attn=int8"], "never applies"),
    ([r"blocks\.0\.=int8-convrot:g=1024"], "cannot be written as int8-convrot"),
])
def test_bad_recipes_are_usage_errors_before_any_work(src, tmp_path, rules, why):
    out = tmp_path / "o.safetensors"
    res = CliRunner().invoke(main, ["convert", str(src), str(out)]
                             + [a for r in rules for a in ("--layer", r)])
    assert res.exit_code == 2, res.output
    assert why in res.output and "Traceback" not in res.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_partial_overlap_is_reported_and_first_match_wins(src, tmp_path):
    rules = (parse_rule(r"blocks\.0\.=int8-convrot"), parse_rule(r"mlp=w4a8"))
    plan = plan_convert(src, tmp_path / "o.safetensors", ConvertOptions(layers=rules))
    assert any("rule 2" in w and "blocks.0.mlp.fc1" in w for w in plan.warnings)
    to = {lay.name: lay.target for lay in plan.layers}
    assert to["blocks.0.mlp.fc1"].startswith("int8_tensorwise")
    assert to["blocks.1.mlp.fc1"].startswith("asym_w4a8_int8")
    assert [u.to_dict()["layers"] for u in plan.rules] == [4, 2 * (BLOCKS - 1)]


def test_rules_on_a_quantized_input(mixed, tmp_path):
    """Back to bf16 for the edge blocks; keep the rest exactly as stored."""
    out = tmp_path / "back.safetensors"
    report = convert(mixed, out, ConvertOptions(target="int8", layers=(
        parse_rule(r"blocks\.(0|5)\.=bf16"), parse_rule(r"blocks\.=keep"))))
    assert report.counts["convert"] == 8
    with Checkpoint(mixed) as a, Checkpoint(out) as b:
        for name in block_linears():
            if name.startswith(("blocks.0.", "blocks.5.")):
                assert b.tensors[name + ".weight"].dtype == "BF16"
                assert name + ".comfy_quant" not in b.tensors
            else:
                for t in a.tensors:
                    if t.startswith(name + "."):
                        assert torch.equal(a.read(t), b.read(t)), t
