"""Specific messages for the mistakes users make: a --lora strength that is no number, a
directory or a missing file; a JSON file given as a checkpoint; a wrong --from file for plan; a
LoRA made for another H3 preset; an NPU re-layout with nothing to measure; one summarised
warning for a LoRA that 4-bit encoding eats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.forge import cli

from h3quant.synth import synth_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("msg")
    path = root / "h3.safetensors"
    synth_checkpoint(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def tiny_lora(base) -> Path:
    path = base.parent / "tiny.lora.safetensors"
    assert cli("synth-lora", path, "--preset", "tiny", "--blocks", "2").exit_code == 0
    return path


def test_lora_spec_mistakes_get_distinct_messages(base, tiny_lora, tmp_path):
    out = tmp_path / "o.safetensors"
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    cases = {
        f"{tiny_lora}:abc": "strength 'abc' is not a number",
        str(lora_dir): "is a directory",
        str(tmp_path / "missing.safetensors"): "no such file",
        f"{tiny_lora}:nan": "finite number",
    }
    seen = set()
    for spec, needle in cases.items():
        res = cli("convert", base, out, "--lora", spec)
        assert res.exit_code == 2, res.output
        assert needle in res.stderr, res.stderr
        seen.add(res.stderr)
    assert len(seen) == len(cases) and not out.exists()


def test_a_json_file_is_not_a_safetensors_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"_class_name": "MiniMaxH3", "hidden": 5376}))
    for cmd in ("inspect", "validate", "plan"):
        res = cli(cmd, bad)
        assert res.exit_code in (1, 2), res.output
        text = res.output
        assert "not a safetensors file" in text and "JSON" in text, text
        assert "header length" not in text.split("not a safetensors file")[0]
        assert not re.search(r"\d{10,}", text), text  # no absurd "header length"


def test_plan_from_a_wrong_file_says_what_is_wrong(base, tmp_path):
    for body, needle in (('{"a": 1}', "is missing"), ("[1, 2]", "JSON object"),
                         ("{not json", "not JSON")):
        f = tmp_path / "pass.json"
        f.write_text(body)
        res = cli("plan", base, "--from", f)
        assert res.exit_code == 2, res.output
        assert needle in res.stderr and "('units')" not in res.stderr, res.stderr


def test_lora_for_another_preset_names_it_and_the_way_out(base, tmp_path):
    full = tmp_path / "full.lora.safetensors"
    assert cli("synth-lora", full, "--preset", "full", "--blocks", "1").exit_code == 0
    res = cli("convert", base, tmp_path / "o.safetensors", "--lora", full)
    assert res.exit_code != 0
    assert "fits the H3 'full' (hidden 5376) preset; the base is 'tiny' (hidden 512)" in res.stderr
    assert "--lora-skip-unmatched" in res.stderr
    res = cli("convert", base, tmp_path / "o.safetensors", "--lora", full,
              "--lora-skip-unmatched")
    assert res.exit_code == 0, res.output
    assert "LoRA key skipped" in res.stderr


def test_npu_relayout_does_not_claim_no_converted_layers(base, tmp_path):
    int8 = tmp_path / "int8.safetensors"
    assert cli("convert", base, int8, "-q").exit_code == 0
    res = cli("convert", int8, tmp_path / "npu.safetensors", "--layout", "npu")
    assert res.exit_code == 0, res.output
    assert "8 layer(s) converted" in res.stderr
    assert "no converted layers" not in res.stderr
    assert "re-laid out bit for bit" in res.stderr


@pytest.mark.slow
def test_w4a8_lora_bake_warns_once(base, tiny_lora, tmp_path):
    res = cli("convert", base, tmp_path / "w4.safetensors", "--to", "w4a8",
              "--lora", f"{tiny_lora}:0.02")
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert "8 layers keep less than" in warnings[0] and "--lora-promote" in warnings[0]
    res = cli("convert", base, tmp_path / "w4b.safetensors", "--to", "w4a8",
              "--lora", f"{tiny_lora}:0.02", "--json")
    doc = json.loads(res.stdout)
    assert len(doc["lora"]["warnings"]) == 8  # the JSON report still lists every layer
