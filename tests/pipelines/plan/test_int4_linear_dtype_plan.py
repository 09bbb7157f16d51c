"""INT4 ConvRot's linear=int8 in recipes and the planner: a rule writes the marker field on the
layers it names only, the planner measures such a layer as GPUs run it (int8 activations),
chooses it per layer by measured noise, says what it costs, and its recipe converts to the
markers it planned (tiny synthetic H3, 1 block)."""

import json

import pytest
from click.testing import CliRunner
from helpers.inputs import input_dims, seeded_inputs

from h3quant.cli import main
from h3quant.errors import ConvertError
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.convert.recipe import parse_rule
from h3quant.pipelines.plan.planner import Model, choose, recipe_rules
from h3quant.pipelines.plan.sensitivity import PlanError, measure, parse_candidates
from h3quant.pipelines.verify.model import ModelInputs

INPUTS = ModelInputs(frames=1, height=8, width=8, audio_frames=8, text_tokens=16, seed=3)
A4, A8 = "int4-convrot+gptq", "int4-convrot:linear=int8+gptq"


def _markers(path) -> dict[str, dict]:
    from helpers.forge import markers_of
    from helpers.kitchen_files import read_all

    return markers_of(read_all(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("a8plan")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    stats = d / "s.stats"
    capture_statistics(src, seeded_inputs(d, input_dims(src), range(4)), stats, predict=False)
    sens = measure(src, formats=("int4-convrot", "int4-convrot:linear=int8"), per_layer=True,
                   inputs=INPUTS, calibration=stats)
    return {"d": d, "src": src, "stats": stats, "sens": sens}


def test_rule_writes_the_field_on_its_layers_only(world, tmp_path):
    out = tmp_path / "mix.safetensors"
    convert(world["src"], out, ConvertOptions(
        target="int4-convrot", report=False,
        layers=(parse_rule(r"mlp\.fc2=int4-convrot:linear=int8"),)))
    markers = _markers(out)
    a8 = sorted(n for n, m in markers.items() if m.get("linear_dtype") == "int8")
    assert a8 and all(n.endswith("mlp.fc2") for n in a8)
    assert all(m["format"] == "convrot_w4a4" for m in markers.values())
    assert all("linear_dtype" not in m for n, m in markers.items() if n not in a8)
    res = CliRunner().invoke(main, ["validate", str(out), "--json"])
    assert res.exit_code == 0, res.output


def test_linear_applies_to_int4_convrot_only():
    with pytest.raises(ConvertError, match="linear= applies"):
        parse_rule("mlp=w4a8:linear=int8")
    with pytest.raises(ConvertError, match="int4 or int8"):
        parse_rule("mlp=int4-convrot:linear=fp8")
    with pytest.raises(PlanError, match="activation choice"):
        parse_candidates("nvfp4:linear=int8")
    two = parse_candidates("w4a8,int4-convrot:g=64,linear=int8+gptq,nvfp4")
    assert [c.format for c in two] == ["w4a8", "int4-convrot:g=64,linear=int8+gptq", "nvfp4"]
    assert parse_candidates(",".join(c.format for c in two)) == two


def test_a8_is_measured_with_int8_activations_and_the_same_bytes(world):
    sens = world["sens"]
    assert sens.formats == [A4, A8]
    table = sens.table()
    better = 0
    for unit, by in table.items():
        a4, a8 = by[A4], by[A8]
        assert 0 < a8.bytes - a4.bytes <= 32  # the marker's field, nothing else
        noise4, noise8 = sum(a4.noise.values()), sum(a8.noise.values())
        better += noise8 < noise4
    assert better == len(table)  # int8 activations remove noise on every layer here


def test_plan_picks_a8_where_the_target_needs_it_and_says_why(world, tmp_path):
    sens = world["sens"]
    model = Model(sens, world["src"].stat().st_size)
    all_a4, all_a8 = model.uniform(A4), model.uniform(A8)
    assert all_a8.min_sqnr_db > all_a4.min_sqnr_db + 1.0
    target = (all_a4.min_sqnr_db + all_a8.min_sqnr_db) / 2
    pred = choose(model, target_sqnr=target)
    chosen = [u for u, f in pred.assignment.items() if f == A8]
    assert 0 < len(chosen) < len(pred.assignment)
    assert set(pred.assignment.values()) <= {A4, A8}
    saved = tmp_path / "pass.json"
    saved.write_text(json.dumps({"sensitivity": sens.to_dict()}))
    recipe = tmp_path / "recipe.json"
    res = CliRunner().invoke(main, [
        "plan", str(world["src"]), "--from", str(saved), "--calibration", str(world["stats"]),
        "--target-sqnr", f"{target:.3f}", "--out", str(recipe), "--json", "-q"])
    assert res.exit_code == 0, res.output
    data = json.loads(recipe.read_text())
    for unit, why in data["reasons"].items():
        if why["format"] == A8:
            assert "int4-weight int8-activation GEMM" in why["why"]
        else:
            assert "GEMM" not in why["why"].split(";")[0]
    rules = recipe_rules(sens, pred.assignment)
    assert any(r.linear_dtype == "int8" for r in rules)
    out = tmp_path / "planned.safetensors"
    conv = CliRunner().invoke(main, ["convert", str(world["src"]), str(out), "--recipe",
                                     str(recipe), "--calibration", str(world["stats"]), "-q"])
    assert conv.exit_code == 0, conv.output
    markers = _markers(out)
    got = sorted(n for n, m in markers.items() if m.get("linear_dtype") == "int8")
    planned = [u for u, why in data["reasons"].items() if why["format"] == A8]
    assert 0 < len(planned) < len(data["reasons"])  # the CLI plans with its margin on top
    assert got == sorted(sens.prefix + u for u in planned), (got, planned)
