"""Untouched layers keep their width: an fp8 source's linears that convert copies rather than
re-encodes are not widened to F32 (kept in float8), and ``--layer`` can
name any linear of the input, also those the preset leaves alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.forge import cli
from helpers.fp8 import fp8_release

from h3quant.formats.container.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return fp8_release(tmp_path_factory.mktemp("untouched"), seed=1)


def _read(path: Path) -> dict[str, torch.Tensor]:
    with Checkpoint(path) as ck:
        return {n: ck.read(n) for n in ck.tensors}


def test_fp8_untouched_linears_are_not_widened(files, tmp_path):
    out, ref = tmp_path / "fp8_int8.safetensors", tmp_path / "bf16_int8.safetensors"
    assert cli("convert", files["fp8"], out, "-q").exit_code == 0
    assert cli("convert", files["bf16"], ref, "-q").exit_code == 0
    src, got = _read(files["fp8"]), _read(out)
    refiner = [n for n in src if n.startswith("token_refiner.") and n.endswith(".weight")
               and src[n].dtype == torch.float8_e4m3fn]
    assert refiner
    for n in refiner:  # kept as float8: the same codes (tests/pipelines/convert/test_convert_fp8_kept.py)
        assert got[n].dtype == torch.float8_e4m3fn
        assert torch.equal(got[n].view(torch.uint8), src[n].view(torch.uint8)), n
    widened = [n for n in got if n in src and src[n].dtype == torch.float8_e4m3fn
               and got[n].dtype == torch.float32]
    assert not widened
    assert out.stat().st_size <= ref.stat().st_size + 4096


def test_layer_rule_names_a_layer_the_preset_leaves(files, tmp_path):
    out = tmp_path / "o.safetensors"
    res = cli("convert", files["fp8"], out, "--layer", r"token_refiner\.=bf16", "-q")
    assert res.exit_code == 0, res.output
    got, src = _read(out), _read(files["fp8"])
    n = "token_refiner.blocks.0.attn.qkv_proj.weight"
    assert got[n].dtype == torch.bfloat16
    scale = src[n[: -len(".weight")] + ".scale_weight"].float()
    assert torch.equal(got[n], (src[n].float() * scale).to(torch.bfloat16))

    out2 = tmp_path / "o2.safetensors"
    res = cli("convert", files["bf16"], out2, "--layer", r"token_refiner\.=int8-convrot", "-q")
    assert res.exit_code == 0, res.output
    got = _read(out2)
    assert got[n].dtype == torch.int8 and got["blocks.0.attn.qkv_proj.weight"].dtype == torch.int8
