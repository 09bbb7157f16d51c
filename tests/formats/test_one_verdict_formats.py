"""One datum, one verdict in every format: a weight whose stored scales are finite and positive
but decode to NaN or infinity (an int4-convrot row scale of 3e38, an nvfp4 ``weight_scale_2``
of 3e38, mxfp8 block scales of 2^127) is found by ``validate --deep`` exactly as convert
refuses it (D106), because both decode through the codec; a NaN or infinity in a tensor
convert copies unchanged is refused as ``validate --deep`` flags it. Files are the tiny
synthetic H3 converted here, then edited here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.cli import run

from h3quant.synth import synth_checkpoint

L = "blocks.0.mlp.fc1"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("verdict")
    base = d / "base.safetensors"
    synth_checkpoint(base, preset="tiny", blocks=1, seed=5, workers=1)
    out = {"base": base}
    for to in ("int4-convrot", "nvfp4", "mxfp8"):
        out[to] = d / f"{to}.safetensors"
        res = run("convert", base, out[to], "--to", to, "--no-report", "-q")
        assert res.exit_code == 0, res.output
    return d, out


def _e8m0(t, value: int, rows=slice(None)):
    raw = t.view(torch.uint8).clone()
    raw[rows] = value
    return raw.view(t.dtype)


def _row(t, row, value):
    t = t.clone()
    t[row] = value
    return t


# (source format, tensor suffix, edit): each finite and > 0, each decodes past fp32's range
EDITS = {
    "int4-convrot row scale 3e38": ("int4-convrot", "weight_scale", lambda t: _row(t, 5, 3e38)),
    "int4-convrot every scale 1e37": ("int4-convrot", "weight_scale",
                                      lambda t: torch.full_like(t, 1e37)),
    "nvfp4 weight_scale_2 3e38": ("nvfp4", "weight_scale_2", lambda t: torch.tensor(3e38)),
    "nvfp4 weight_scale_2 1e36": ("nvfp4", "weight_scale_2", lambda t: torch.tensor(1e36)),
    "mxfp8 block scales 254": ("mxfp8", "weight_scale", lambda t: _e8m0(t, 254)),
    "mxfp8 one row of 2^127": ("mxfp8", "weight_scale", lambda t: _e8m0(t, 254, 7)),
}


def _edited(made, fmt, suffix, edit, name):
    d, out = made
    t = load_file(str(out[fmt]))
    t[f"{L}.{suffix}"] = edit(t[f"{L}.{suffix}"])
    p = d / f"{name.replace(' ', '-')}.safetensors"
    save_file(t, str(p))
    return p


def _deep_errors(path) -> list[dict]:
    res = run("validate", path, "--deep", "--json")
    return [f for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize("name", sorted(EDITS))
def test_decoded_overflow_gets_one_verdict(made, tmp_path, name):
    fmt, suffix, edit = EDITS[name]
    src = _edited(made, fmt, suffix, edit, name)
    errors = _deep_errors(src)
    assert [(f["code"], f["tensor"]) for f in errors] == [("D106", f"{L}.weight")], errors
    for to in ("bf16", "int8"):
        o = tmp_path / f"{to}.safetensors"
        res = run("convert", src, o, "--to", to, "--no-report", "-q")
        assert res.exit_code == 1 and "D106" in res.output, (to, res.output)
        assert not o.exists()


@pytest.mark.parametrize("fmt", ["int4-convrot", "nvfp4", "mxfp8"])
def test_valid_files_decode_clean(made, fmt):
    assert _deep_errors(made[1][fmt]) == []


# a tensor convert copies unchanged (no layer of its own), by dtype and bad value
COPIED = [("audio_patch_proj.bias", torch.float32, float("nan")),
          ("audio_patch_proj.bias", torch.float16, float("inf")),
          ("audio_patch_proj.bias", torch.bfloat16, float("-inf")),
          ("audio_patch_proj.bias", torch.float64, float("nan"))]


@pytest.mark.parametrize("name,dtype,value", COPIED, ids=lambda x: str(x))
@pytest.mark.parametrize("fmt", ["base", "int4-convrot"])
def test_a_non_finite_copied_tensor_is_refused_like_validate_deep_flags_it(made, tmp_path, fmt,
                                                                            name, dtype, value):
    d, out = made
    t = load_file(str(out[fmt]))
    assert name in t
    bad = t[name].to(dtype).clone()
    bad.view(-1)[7] = value
    t[name] = bad
    src = tmp_path / "src.safetensors"
    save_file(t, str(src))
    assert [(f["code"], f["tensor"]) for f in _deep_errors(src)] == [("D106", name)]
    o = tmp_path / "o.safetensors"
    res = run("convert", src, o, "--to", "int8", "--no-report", "-q")
    assert res.exit_code == 1 and "D106" in res.output and name in res.output, res.output
    assert "flat index 7" in res.output
    assert not o.exists()


@pytest.mark.parametrize("name", ["int4-convrot row scale 3e38", "nvfp4 weight_scale_2 3e38",
                                  "mxfp8 block scales 254"])
@pytest.mark.parametrize("how", ["another layer converted", "kept in its format"])
def test_a_broken_layer_copied_as_it_is_is_refused(made, tmp_path, name, how):
    """The layer is not converted (another one is, or the target is its own format): convert
    copies it as it is, and refuses it as validate --deep flags it."""
    fmt, suffix, edit = EDITS[name]
    src = _edited(made, fmt, suffix, edit, name)
    o = tmp_path / "o.safetensors"
    extra = (["--to", "int8", "--include", r"blocks\.0\.attn\.qkv_proj"]
             if how == "another layer converted" else ["--to", fmt])
    res = run("convert", src, o, *extra, "--no-report", "-q")
    assert res.exit_code == 1 and "D106" in res.output and L in res.output, res.output
    assert not o.exists()
