"""One rule set: validate, convert and verify give the same verdict on the same file, and
convert refuses source data that breaks validate --deep's rules instead of re-encoding it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.forge import W4A8, cli, int8_layer, quantized_synth, save, w4a8_layer
from h3quant.formats.container.checkpoint import Checkpoint

LAYER = "blocks.0.mlp.fc1"


def _h3_with(tmp_path: Path, edit) -> Path:
    """The tiny quantized H3 synth with ``edit(tensors)`` applied to its tensors."""
    base = quantized_synth(tmp_path / "base.safetensors")
    with Checkpoint(base) as ck:
        tensors = {n: ck.read(n).clone() for n in ck.tensors}
    base.unlink()
    edit(tensors)
    return save(tmp_path / "case.safetensors", tensors)


def _f16_scale(t):
    t[f"{LAYER}.weight_scale"] = t[f"{LAYER}.weight_scale"].half()


def _scalar_scale_convrot(t):
    t[f"{LAYER}.weight_scale"] = torch.tensor(0.01)


def _w4a8(t, *, marker=None, channel_2d=False):
    n, k = t[f"{LAYER}.weight"].shape
    for s in ("weight", "weight_scale", "comfy_quant"):
        t.pop(f"{LAYER}.{s}", None)
    t.update(w4a8_layer(LAYER, n, k, marker=marker))
    if channel_2d:
        t[f"{LAYER}.weight_s_channel"] = t[f"{LAYER}.weight_s_channel"].reshape(n, 1)


CASES = {
    "f16-scale": (_f16_scale, False),
    "scalar-scale-with-convrot": (_scalar_scale_convrot, False),
    "w4a8-convrot-false": (lambda t: _w4a8(t, marker=dict(W4A8, convrot=False)), False),
    "w4a8-s_channel-[N,1]": (lambda t: _w4a8(t, channel_2d=True), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_convert_verify_give_one_verdict(tmp_path, case):
    edit, ok = CASES[case]
    f = _h3_with(tmp_path, edit)
    v = cli("validate", f, "--json")
    findings = {x["code"] for x in json.loads(v.stdout)["findings"] if x["severity"] == "error"}
    validate_ok = v.exit_code == 0
    c = cli("convert", f, tmp_path / "o.safetensors", "--to", "bf16", "--include",
            LAYER.replace(".", r"\."), "--no-report")
    convert_ok = c.exit_code == 0
    r = cli("verify", f, "--blocks", "1", "--tokens", "8")
    verify_refused = r.exit_code == 2 and "[Q" in r.output or "[M" in r.output
    assert validate_ok is ok, (case, findings)
    assert convert_ok is ok, (case, c.output)
    assert (not verify_refused) is ok, (case, r.output)
    if not ok:
        code = next(iter(findings & {"Q102", "Q103", "M114"}))
        assert code in c.output and code in r.output, (code, c.output, r.output)
        assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("bad", ["negative", "nan", "zero", "inf"])
@pytest.mark.parametrize("target", ["bf16", "int8", "w4a8"])
def test_convert_refuses_bad_source_scales_like_validate_deep(tmp_path, bad, target):
    value = {"negative": -0.02, "nan": float("nan"), "zero": 0.0, "inf": float("inf")}[bad]
    t = int8_layer("blocks.0.mlp.fc1", 16, 256)
    t["blocks.0.mlp.fc1.weight_scale"][3, 0] = value
    f = save(tmp_path / "s.safetensors", t)
    deep = cli("validate", f, "--deep", "--json")
    code = "D101" if bad in ("nan", "inf") else "D102"
    assert deep.exit_code == 1 and code in {x["code"] for x in json.loads(deep.stdout)["findings"]}
    out = tmp_path / "o.safetensors"
    res = cli("convert", f, out, "--to", target, "--overwrite")
    assert res.exit_code == 1, res.output
    assert code in res.output and "nothing written" in res.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_convert_refuses_non_finite_float_weights(tmp_path, bad):
    w = torch.randn(16, 256).bfloat16()
    w[5, 7] = bad
    f = save(tmp_path / "s.safetensors", {"blocks.0.mlp.fc1.weight": w})
    assert cli("validate", f, "--deep").exit_code == 1
    res = cli("convert", f, tmp_path / "o.safetensors", "--to", "int8-convrot")
    assert res.exit_code == 1 and "D106" in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()


def test_w4a8_source_with_a_zero_channel_scale_is_refused(tmp_path):
    t = w4a8_layer("blocks.0.mlp.fc1", 16, 256)
    t["blocks.0.mlp.fc1.weight_s_channel"][2] = 0.0
    f = save(tmp_path / "s.safetensors", t)
    res = cli("convert", f, tmp_path / "o.safetensors", "--to", "bf16")
    assert res.exit_code == 1 and "D102" in res.output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_finite_weights_rule_finds_every_nan_and_inf_and_nothing_else(dtype):
    """``weight_violation`` answers from one sum when the chunk is finite: every NaN / inf is
    still found with its exact count and first index, and finite chunks whose sum overflows
    (the values near the dtype's maximum) pass."""
    from h3quant.formats.check import weight_violation

    gen = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    assert weight_violation(torch.full((4, 64), big, dtype=dtype)) is None  # sum overflows
    assert weight_violation(torch.tensor([big, -big, big], dtype=dtype)) is None
    assert weight_violation(torch.empty(0, 8, dtype=dtype)) is None
    for trial in range(40):
        w = torch.randn(37, 53, generator=gen).to(dtype)
        if trial % 3 == 0:
            w[:, :5] = big  # overflowing sum around the bad values too
        assert weight_violation(w) is None
        bad = torch.randperm(w.numel(), generator=gen)[: 1 + trial % 4]
        for i, pos in enumerate(bad.tolist()):
            w.view(-1)[pos] = (float("nan"), float("inf"), float("-inf"))[(i + trial) % 3]
        v = weight_violation(w, offset=1000)
        assert v is not None and v.code == "D106"
        assert f"{len(bad)} non-finite" in v.message
        assert f"flat index {1000 + int(bad.min())})" in v.message


def test_a_finite_weight_chunk_is_checked_without_an_elementwise_pass(monkeypatch):
    from h3quant.formats.check import weight_violation

    sizes = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real(t))
    assert weight_violation(torch.randn(195, 5376).bfloat16()) is None
    assert sizes == [1]  # only the sum's
