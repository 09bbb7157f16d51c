"""Arithmetic on user numbers never ends in exit 3: every option has a documented range checked
at parse time, every field of a saved pass is checked before use, a LoRA stored as fp8 is
refused from its header. And a result belongs to its inputs: a pass measured on one checkpoint
is refused for any other."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hostile_util import sparse_safetensors, tiny_base

from helpers.cli import run

from h3quant.pipelines.fingerprint import checkpoint_fingerprint
from h3quant.pipelines.plan.sensitivity import Candidate, measure
from h3quant.pipelines.verify.model import ModelInputs

INPUTS = ModelInputs(frames=1, height=8, width=8, audio_frames=8, text_tokens=16, seed=3)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("nums")
    src = tiny_base(d / "two.safetensors", blocks=2, seed=21)
    sens = measure(src, formats=(Candidate("w4a8"),), inputs=INPUTS)
    saved = d / "pass.json"
    saved.write_text(json.dumps({"sensitivity": sens.to_dict()}))
    return {"dir": d, "src": src, "pass": saved, "doc": sens.to_dict()}


@pytest.mark.parametrize("args", [["--target-sqnr", "1e9"], ["--target-sqnr", "-1e9"],
                                  ["--target-sqnr", "nan"], ["--frontier", "--no-measure",
                                                             "--targets", "1e9"],
                                  ["--frontier", "--no-measure", "--targets", "-1e9"],
                                  ["--frontier", "--no-measure", "--targets", "20,1e308"]])
def test_wild_sqnr_targets_are_usage_errors(env, args):
    res = run("plan", env["src"], "--from", env["pass"], *args)
    assert res.exit_code == 2, res.output


def test_targets_at_the_documented_bounds_work(env):
    res = run("plan", env["src"], "--from", env["pass"], "--target-sqnr", "300")
    assert res.exit_code in (0, 2), res.output  # may be unreachable: a plan error, not a crash
    res = run("plan", env["src"], "--from", env["pass"], "--target-sqnr", "-300")
    assert res.exit_code == 0, res.output


def _forge(env, tmp_path, change):
    doc = copy.deepcopy(env["doc"])
    change(doc)
    p = tmp_path / "forged.json"
    p.write_text(json.dumps(doc))
    return p


FORGERIES = {
    "zero signal": lambda d: d["signal"].update(video=0.0),
    "negative signal": lambda d: d["signal"].update(audio=-1),
    "signal as text": lambda d: d["signal"].update(audio="lots"),
    "unknown unit": lambda d: d["units"][0].update(unit="blocks.99.attn.qkv_proj"),
    "unit of no block": lambda d: d["units"][0].update(unit="token_refiner"),
    "unknown format": lambda d: d["units"][0].update(format="int3"),
    "unknown pass format": lambda d: d.update(formats=["int3"]),
    "negative noise": lambda d: d["units"][0]["noise"].update(video=-5),
    "nan noise": lambda d: d["units"][0]["noise"].update(video="nan"),
    "huge blocks": lambda d: d.update(blocks=10**12),
    "no units": lambda d: d.update(units=[]),
    "bytes as float": lambda d: d["units"][0].update(bytes=1.5),
    "units not a list": lambda d: d.update(units={"a": 1}),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_passes_are_usage_errors_naming_the_field(env, tmp_path, name):
    p = _forge(env, tmp_path, FORGERIES[name])
    res = run("plan", env["src"], "--from", p, "--target-sqnr", "20")
    assert res.exit_code == 2, res.output
    assert "--from" in res.output


def test_a_pass_is_refused_for_another_checkpoint(env):
    four = tiny_base(env["dir"] / "four.safetensors", blocks=4, seed=21)
    res = run("plan", four, "--from", env["pass"], "--target-sqnr", "20")
    assert res.exit_code == 2 and "measured on another checkpoint" in res.output, res.output
    other = tiny_base(env["dir"] / "other.safetensors", blocks=2, seed=22)  # same shapes
    res = run("plan", other, "--from", env["pass"], "--target-sqnr", "20")
    assert res.exit_code == 2 and "weights" in res.output, res.output
    res = run("plan", env["src"], "--from", env["pass"], "--target-sqnr", "20")
    assert res.exit_code == 0, res.output


def test_a_pass_without_its_origin_is_refused(env, tmp_path):
    p = _forge(env, tmp_path, lambda d: d.pop("measured_on"))
    res = run("plan", env["src"], "--from", p, "--target-sqnr", "20")
    assert res.exit_code == 2 and "measured on" in res.output, res.output


def test_the_fingerprint_records_blocks_and_inputs(env):
    fp = checkpoint_fingerprint(env["src"])
    assert fp["blocks"] == 2 and len(fp["header_sha256"]) == 64
    assert env["doc"]["measured_on"]["inputs"]["seed"] == 3
    assert env["doc"]["measured_on"]["checkpoint"] == fp


def test_a_lora_stored_as_fp8_is_refused_from_its_header(env, tmp_path):
    m = "diffusion_model.blocks.0.attn.qkv_proj"
    lora = sparse_safetensors(tmp_path / "fp8.safetensors", {
        f"{m}.lora_down.weight": ("F8_E4M3", [2, 512]),
        f"{m}.lora_up.weight": ("F8_E4M3", [1536, 2])})
    res = run("convert", env["src"], tmp_path / "o.safetensors", "--lora", lora, "--to", "bf16")
    assert res.exit_code == 1 and "F8_E4M3" in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()


def test_an_alpha_of_wild_type_is_refused(env, tmp_path):
    from safetensors.torch import save_file

    m = "diffusion_model.blocks.0.attn.qkv_proj"
    save_file({f"{m}.lora_down.weight": torch.zeros(2, 512, dtype=torch.bfloat16),
               f"{m}.lora_up.weight": torch.zeros(1536, 2, dtype=torch.bfloat16),
               f"{m}.alpha": torch.zeros((), dtype=torch.bool)}, str(tmp_path / "a.safetensors"))
    res = run("convert", env["src"], tmp_path / "o.safetensors", "--lora",
              tmp_path / "a.safetensors", "--to", "bf16")
    assert res.exit_code == 1 and "alpha" in res.output, res.output
