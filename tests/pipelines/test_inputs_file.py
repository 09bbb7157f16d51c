"""Whole-model inputs from a file: plan --inputs and verify --model --inputs run on the very
latents in the file (the same numbers as the equal seeded inputs, other numbers for others), bad
files are usage errors naming the file and tensor, and plan's --out/--plot follow the output
rules together."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from h3quant.cli import main
from h3quant.errors import UsageError
from h3quant.pipelines.plan.sensitivity import Candidate, measure
from h3quant.pipelines.verify.model import ModelInputs, verify_model
from h3quant.runtime.model.model import H3Model
from h3quant.synth import synth_checkpoint

SEEDED = ModelInputs(frames=1, height=8, width=8, audio_frames=8, text_tokens=16, seed=5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=4)
    q = d / "int8.safetensors"
    r = CliRunner().invoke(main, ["convert", str(src), str(q), "--to", "int8-convrot",
                                  "--no-report"])
    assert r.exit_code == 0, r.output
    with H3Model.open(src, "cpu") as m:
        dims = (m.video_channels, m.audio_channels, m.text_dim)
    # the file's latents, drawn here with the test's own generator
    g = torch.Generator().manual_seed(99)
    lat = {"video": torch.randn(1, dims[0], 1, 8, 8, generator=g),
           "audio": torch.randn(1, dims[1], 2, 8, generator=g),
           "text": torch.randn(1, 16, dims[2], generator=g)}
    good = d / "lat.safetensors"
    save_file(lat, str(good))
    # the seeded inputs' own tensors, saved: a file must give exactly the seeded run
    v, a, t = SEEDED.tensors(*dims)
    same = d / "same.safetensors"
    save_file({"video": v, "audio": a, "text": t,
               "sigma": torch.tensor([SEEDED.sigma], dtype=torch.float64)}, str(same))
    return {"src": src, "q": q, "good": good, "same": same, "dims": dims, "lat": lat, "dir": d}


def _sqnr(res):
    return {o.name: o.sqnr_db for o in res.outputs}


def test_sizes_come_from_the_header(files):
    mi = ModelInputs.from_file(files["good"])
    assert (mi.frames, mi.height, mi.width, mi.audio_frames, mi.text_tokens) == (1, 8, 8, 8, 16)
    assert mi.sigma == 0.6  # the file holds none: the default
    assert ModelInputs.from_file(files["same"], sigma=0.3).sigma == SEEDED.sigma
    v, a, t = mi.tensors(*files["dims"])
    assert torch.equal(v, files["lat"]["video"]) and torch.equal(t, files["lat"]["text"])


@pytest.mark.slow
def test_verify_on_the_file_equals_the_seeded_run_with_those_values(files):
    seeded = verify_model(files["q"], reference=files["src"], inputs=SEEDED)
    from_file = verify_model(files["q"], reference=files["src"],
                             inputs=ModelInputs.from_file(files["same"]))
    other = verify_model(files["q"], reference=files["src"],
                         inputs=ModelInputs.from_file(files["good"]))
    assert _sqnr(from_file) == _sqnr(seeded)
    assert _sqnr(other)["video"] != _sqnr(seeded)["video"]  # other latents, other numbers


@pytest.mark.slow
def test_plan_measures_on_the_file(files):
    cands = (Candidate("w4a8"),)
    seeded = measure(files["src"], formats=cands, inputs=SEEDED)
    from_file = measure(files["src"], formats=cands, inputs=ModelInputs.from_file(files["same"]))
    assert [u.noise for u in from_file.units] == [u.noise for u in seeded.units]
    assert from_file.inputs["file"] == str(files["same"])


@pytest.mark.slow
def test_cli_verify_and_plan_take_inputs(files):
    r = CliRunner().invoke(main, ["verify", str(files["q"]), "--model", "--reference",
                                  str(files["src"]), "--inputs", str(files["same"]), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["file"] == str(files["same"])
    want = _sqnr(verify_model(files["q"], reference=files["src"], inputs=SEEDED))
    got = {o["name"]: o["sqnr_db"] for o in doc["outputs"]}
    assert got["video"] == pytest.approx(want["video"], abs=1e-9)
    r = CliRunner().invoke(main, ["plan", str(files["src"]), "--formats", "w4a8", "--inputs",
                                  str(files["good"]), "--json", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["sensitivity"]["inputs"]["file"] == str(files["good"])


def _bad(d, name, tensors):
    p = d / name
    save_file(tensors, str(p))
    return p


def test_bad_inputs_files_name_the_file_and_tensor(files):
    d, (cv, ca, ct) = files["dir"], files["dims"]
    ok = {"video": torch.zeros(1, cv, 1, 4, 4), "audio": torch.zeros(1, ca, 2, 4),
          "text": torch.zeros(1, 4, ct)}
    cases = [
        ({k: v for k, v in ok.items() if k != "audio"}, None, "no 'audio' tensor"),
        ({**ok, "video": torch.zeros(1, cv, 4, 4)}, "video", "expected 5 dimensions"),
        ({**ok, "audio": torch.zeros(1, ca, 3, 4)}, "audio", "stereo"),
        ({**ok, "text": torch.zeros(1, 4, ct, dtype=torch.int32)}, "text", "float tensor"),
        ({**ok, "extra": torch.zeros(1)}, "extra", "unexpected tensor"),
        ({**ok, "sigma": torch.zeros(2)}, "sigma", "one float value"),
        # sizes beyond the whole-model row limit: refused from the header (one channel here)
        ({**ok, "video": torch.zeros(1, 1, 1, 256, 258)}, None, "the limit is"),
    ]
    for n, (tensors, tensor, why) in enumerate(cases):
        p = _bad(d, f"bad{n}.safetensors", tensors)
        with pytest.raises(UsageError) as e:
            ModelInputs.from_file(p)
        assert why in str(e.value), (n, str(e.value))
        assert str(p) in str(e.value)
        if tensor:
            assert e.value.tensor == tensor
    # shapes fine in the header, wrong for the model or non-finite: refused when read
    for n, (tensors, why) in enumerate([
            ({**ok, "video": torch.zeros(1, cv + 1, 1, 4, 4)}, "the model takes"),
            ({**ok, "text": torch.full((1, 4, ct), float("nan"))}, "non-finite"),
            ({**ok, "sigma": torch.tensor([1.5])}, "(0, 1]")]):
        p = _bad(d, f"late{n}.safetensors", tensors)
        with pytest.raises(UsageError) as e:
            ModelInputs.from_file(p).tensors(cv, ca, ct)
        assert why in str(e.value)
    r = CliRunner().invoke(main, ["verify", str(files["q"]), "--model", "--inputs",
                                  str(d / "bad0.safetensors")])
    assert r.exit_code == 2 and "no 'audio' tensor" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("cmd, why", [
    (["verify", "Q", "--inputs", "L"], "cannot be used with the per-block mode"),
    (["verify", "Q", "--model", "--inputs", "L", "--seed", "3"], "cannot be used with --inputs"),
    (["verify", "Q", "--model", "--inputs", "L", "--frames", "3"], "cannot be used with --inputs"),
    (["verify", "Q", "--model", "--inputs", "S", "--sigma", "0.3"], "conflicts with the sigma"),
    (["plan", "F", "--inputs", "L", "--seed", "3"], "cannot be used with --inputs"),
    (["plan", "F", "--inputs", "NOPE"], "no such file or folder"),
])
def test_cli_usage_errors(files, cmd, why):
    names = {"Q": files["q"], "L": files["good"], "S": files["same"], "F": files["src"],
             "NOPE": files["dir"] / "missing.safetensors"}
    r = CliRunner().invoke(main, [str(names.get(a, a)) for a in cmd])
    assert r.exit_code == 2, r.output
    assert why in r.output, r.output


@pytest.mark.slow
def test_plan_outputs_follow_the_output_rules_together(files, tmp_path):
    src = files["src"]
    before = src.read_bytes()
    sens = tmp_path / "sens.json"
    r = CliRunner().invoke(main, ["plan", str(src), "--formats", "w4a8", "--inputs",
                                  str(files["good"]), "--json", "-q"])
    sens.write_text(r.stdout)
    recipe = tmp_path / "recipe.json"
    # the plot would replace the input: refused before any work, and the recipe not written
    r = CliRunner().invoke(main, ["plan", str(src), "--from", str(sens), "--max-size", "1GB",
                                  "--out", str(recipe), "--frontier", "--no-measure",
                                  "--plot", str(src), "--overwrite", "-q"])
    assert r.exit_code == 2 and "the plot is the input" in r.output, r.output
    assert not recipe.exists() and src.read_bytes() == before
    # the plot names the saved pass, an input too
    r = CliRunner().invoke(main, ["plan", str(src), "--from", str(sens), "--frontier",
                                  "--no-measure", "--plot", str(sens), "--overwrite", "-q"])
    assert r.exit_code == 2 and "the plot is the input" in r.output, r.output
    # an existing plot without --overwrite: refused before work, nothing written
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"old")
    r = CliRunner().invoke(main, ["plan", str(src), "--from", str(sens), "--max-size", "1GB",
                                  "--out", str(recipe), "--frontier", "--no-measure",
                                  "--plot", str(taken), "-q"])
    assert r.exit_code == 2 and "pass --overwrite" in r.output, r.output
    assert not recipe.exists() and taken.read_bytes() == b"old"
    # --out and --plot the same path: refused
    r = CliRunner().invoke(main, ["plan", str(src), "--from", str(sens), "--max-size", "1GB",
                                  "--out", str(recipe), "--frontier", "--no-measure",
                                  "--plot", str(recipe), "-q"])
    assert r.exit_code == 2 and "two outputs name the same file" in r.output, r.output
    assert not recipe.exists()


@pytest.mark.slow
def test_plan_writes_recipe_and_plot_together(files, tmp_path):
    pytest.importorskip("matplotlib")
    src, recipe, png = files["src"], tmp_path / "r.json", tmp_path / "f.png"
    sens = tmp_path / "sens.json"
    r = CliRunner().invoke(main, ["plan", str(src), "--formats", "w4a8", "--json", "-q"])
    sens.write_text(r.stdout)
    r = CliRunner().invoke(main, ["plan", str(src), "--from", str(sens), "--max-size", "1GB",
                                  "--out", str(recipe), "--frontier", "--no-measure",
                                  "--plot", str(png), "-q"])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(recipe.read_text())["rules"]
