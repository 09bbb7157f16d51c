"""One verdict for one datum: fp8 weights that decode to inf or NaN (a finite scale of 3e38, a
NaN code, an e5m2 infinity code) get the same verdict (D106) from validate --deep, convert to
every target and verify; a valid scaled-fp8 file gets none, and inspect's error count is
validate's on every file. The fp8 files are made here (codes and scales written by this test)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from helpers.cli import run

from h3quant.cli import main
from h3quant.formats import registry
from h3quant.synth import synth_checkpoint
from h3quant.synth.layouts import write_layout

W = "blocks.0.attn.qkv_proj.weight"
S = "blocks.0.attn.qkv_proj.scale_weight"
# every target convert can write without calibration data (a format that needs it refuses
# with its own usage error before reading any weight)
TARGETS = sorted(t for t in registry.targets()
                 if not registry.target_codec(t).spec.encoding.write_refusal)


def _fp8(t: dict, code: int, dtype=torch.float8_e4m3fn) -> dict:
    out = dict(t)
    raw = t[W].to(torch.float32).to(dtype).view(torch.uint8).clone()
    raw[0, 0] = code
    out[W] = raw.view(dtype)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    plain = d / "plain.safetensors"
    synth_checkpoint(plain, preset="tiny", blocks=1, seed=5, workers=1)
    good = d / "good.safetensors"
    write_layout(plain, good, "comfy", fp8=True)
    t = load_file(str(good))
    assert t[W].dtype == torch.float8_e4m3fn and S in t
    big = dict(t)
    big[S] = torch.full_like(t[S], 3e38)  # finite, but code x scale overflows fp32
    out = {"good": good}
    for name, tensors in {"big_scale": big, "nan_code": _fp8(t, 0x7F),
                          "e5m2_inf": _fp8(t, 0x7C, torch.float8_e5m2)}.items():
        out[name] = d / f"{name}.safetensors"
        save_file(tensors, str(out[name]))
    q = d / "q.safetensors"
    res = CliRunner().invoke(main, ["convert", str(good), str(q), "--no-report", "-q"])
    assert res.exit_code == 0, res.output
    out["q"] = q
    return out


def _errors_from_validate(path, deep=False) -> tuple[int, list[str]]:
    res = run("validate", path, "--json", *(["--deep"] if deep else []))
    doc = json.loads(res.stdout)
    return doc["counts"]["error"], [f["code"] for f in doc["findings"]
                                    if f["severity"] == "error"]


def _errors_from_inspect(path) -> int:
    res = run("inspect", path, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["findings"]["error"]


@pytest.mark.parametrize("name", ["good", "big_scale", "nan_code", "e5m2_inf"])
def test_inspect_counts_what_validate_reports(files, name):
    n, codes = _errors_from_validate(files[name])
    assert _errors_from_inspect(files[name]) == n, codes
    if name == "good":
        assert n == 0, codes  # a valid scaled-fp8 file: no "errors" anywhere


def test_a_valid_fp8_file_passes_everywhere(files, tmp_path):
    assert _errors_from_validate(files["good"], deep=True)[0] == 0
    for to in TARGETS:
        res = run("convert", files["good"], tmp_path / f"{to}.safetensors", "--to", to,
                  "--no-report", "-q")
        assert res.exit_code == 0, (to, res.output)
    res = run("verify", files["q"], "--reference", files["good"], "--blocks", "1")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("name", ["big_scale", "nan_code", "e5m2_inf"])
def test_non_finite_fp8_gets_one_verdict_from_every_command(files, tmp_path, name):
    src = files[name]
    n, codes = _errors_from_validate(src, deep=True)
    assert "D106" in codes, codes
    verdicts = {"validate --deep": "D106"}
    for to in TARGETS:
        out = tmp_path / f"{to}.safetensors"
        res = run("convert", src, out, "--to", to, "--no-report", "-q")
        verdicts[f"convert --to {to}"] = "D106" if (res.exit_code == 1 and "D106" in res.output) \
            else f"exit {res.exit_code}: {res.output[-200:]}"
        assert not out.exists()
    res = run("verify", files["q"], "--reference", src, "--blocks", "1")
    verdicts["verify --reference"] = "D106" if (res.exit_code == 1 and "D106" in res.output) \
        else f"exit {res.exit_code}: {res.output[-200:]}"
    assert set(verdicts.values()) == {"D106"}, verdicts
