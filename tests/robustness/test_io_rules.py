"""Every file a command reads is an input, and no output may name one: a LoRA, a recipe, an
``--inputs`` latents file, a saved ``--from`` pass, a reference. Each case names an input as an
output (with ``--overwrite``) and checks exit status 2 and the input's sha256 unchanged."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from hostile_util import h3q, sha, tiny_base, tiny_lora

from h3quant.cli import main as cli_main
from h3quant.errors import OutputError
from h3quant.formats.container.iofiles import CommandFiles


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("io")
    base = tiny_base(d / "base.safetensors")
    lora = tiny_lora(d / "lora.safetensors")
    recipe = d / "recipe.json"
    recipe.write_text(json.dumps({"rules": [{"layer": "blocks", "format": "int8-convrot"}]}))
    passf = d / "pass.json"
    passf.write_text("{}")
    inputs = d / "lat.safetensors"
    inputs.write_bytes(lora.read_bytes())  # any file: it must not be read before the check
    return {"dir": d, "base": base, "lora": lora, "recipe": recipe, "pass": passf,
            "inputs": inputs}


def run(*args):
    return CliRunner().invoke(cli_main, [str(a) for a in args])


def _refused(res, victim, before):
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert sha(victim) == before
    assert "Traceback" not in res.output
    return res.output


@pytest.mark.parametrize("where", ["out", "report", "dry-run"])
def test_convert_never_writes_over_its_lora(files, where):
    lora, base, d = files["lora"], files["base"], files["dir"]
    before = sha(lora)
    out = lora if where != "report" else d / "o.safetensors"
    extra = ["--report", lora] if where == "report" else (["--dry-run"] if where == "dry-run"
                                                          else [])
    res = run("convert", base, out, "--lora", f"{lora}:0.5", "--overwrite", *extra)
    msg = _refused(res, lora, before)
    assert "LoRA" in msg and "reads" in msg
    assert not (d / "o.safetensors").exists()


@pytest.mark.parametrize("where", ["out", "report"])
def test_convert_never_writes_over_its_recipe(files, where):
    recipe, base, d = files["recipe"], files["base"], files["dir"]
    before = sha(recipe)
    out = recipe if where == "out" else d / "o.safetensors"
    extra = ["--report", recipe] if where == "report" else []
    res = run("convert", base, out, "--recipe", recipe, "--overwrite", *extra)
    assert "recipe" in _refused(res, recipe, before)


def test_convert_api_refuses_its_lora_as_output(files):
    from h3quant.pipelines.convert import ConvertOptions, convert

    lora = files["lora"]
    before = sha(lora)
    with pytest.raises(OutputError, match="LoRA"):
        convert(files["base"], lora, ConvertOptions(loras=(str(lora),), overwrite=True))
    assert sha(lora) == before


def test_convert_refuses_a_hard_link_to_its_lora(files, tmp_path):
    lora = files["lora"]
    link = tmp_path / "alias.safetensors"
    os.link(lora, link)
    before = sha(lora)
    res = run("convert", files["base"], link, "--lora", lora, "--overwrite")
    _refused(res, lora, before)


@pytest.mark.parametrize("victim", ["pass", "inputs"])
def test_plan_never_writes_over_a_file_it_reads(files, victim):
    path = files[victim]
    before = sha(path)
    opt = ["--from", path] if victim == "pass" else ["--inputs", path]
    res = run("plan", files["base"], *opt, "--target-sqnr", "20", "--out", path, "--overwrite")
    _refused(res, path, before)


@pytest.mark.parametrize("victim", ["inputs", "reference"])
def test_verify_plot_never_names_a_file_it_reads(files, victim):
    path = files["inputs"] if victim == "inputs" else files["lora"]
    before = sha(path)
    opt = ["--inputs", path] if victim == "inputs" else ["--reference", path]
    res = run("verify", files["base"], "--model", *opt, "--plot", path, "--overwrite")
    _refused(res, path, before)


def test_a_real_process_exits_2_and_leaves_the_lora(files):
    lora = files["lora"]
    before = sha(lora)
    res = h3q("convert", files["base"], lora, "--lora", lora, "--overwrite", timeout=120)
    assert res.returncode == 2, res.stderr
    assert sha(lora) == before and "Traceback" not in res.stderr


def test_command_files_names_what_was_read(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("{}")
    f = CommandFiles("x")
    f.read(a, "calibration statistics")
    f.read(None, "nothing")
    f.write(a, "card")
    with pytest.raises(OutputError, match="calibration statistics"):
        f.check()
    g = CommandFiles("x")
    g.read(a, "card")
    g.write(tmp_path / "b.json", "card")
    g.check()  # distinct: fine
    with g.transaction(overwrite=False) as outs:
        staged = outs.add(tmp_path / "b.json", what="card")
        staged.write_text("{}")
        g.read(tmp_path / "c.json", "late input")  # inputs found later still count
    assert (tmp_path / "b.json").exists()
