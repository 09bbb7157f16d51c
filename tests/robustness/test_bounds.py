"""Every file read is bounded before it is read: a recipe or a saved pass from a FIFO or
/dev/zero, a LoRA naming gigabytes of stray data or an absurd rank, an --inputs file whose text
tensor has the wrong width. Each child runs under a memory cap (never above this process's own
hard limit) and a timeout; a regression fails with an error, not an exhausted machine."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hostile_util import h3q, sha, sparse_safetensors, tiny_base, tiny_lora

from h3quant import limits

GIB = 1 << 30


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("b") / "base.safetensors")


def _quick(res, t0, code=2, budget=60):
    assert time.monotonic() - t0 < budget
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    return res.stderr


def test_recipe_from_a_fifo_is_refused_not_waited_on(base, tmp_path):
    fifo = tmp_path / "recipe.json"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--recipe", fifo, timeout=60)
    assert "FIFO" in _quick(res, t0)
    assert not (tmp_path / "o.safetensors").exists()


def test_recipe_from_dev_zero_is_refused_before_reading(base, tmp_path):
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--recipe", "/dev/zero", timeout=60)
    assert "device" in _quick(res, t0)


def test_a_recipe_past_the_limit_is_refused_from_its_size(base, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(limits.MAX_JSON_BYTES + 1)
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--recipe", big, timeout=60)
    assert "limit" in _quick(res, t0)


@pytest.mark.parametrize("src", ["/dev/zero", "fifo"])
def test_plan_from_a_non_regular_file_is_refused(base, tmp_path, src):
    if src == "fifo":
        src = tmp_path / "pass.json"
        os.mkfifo(src)
    t0 = time.monotonic()
    res = h3q("plan", base, "--from", src, timeout=60)
    assert "not a regular file" in _quick(res, t0)


def _adapter(hidden=512, rank=2):
    down = torch.zeros(rank, hidden, dtype=torch.bfloat16)
    up = torch.zeros(3 * hidden, rank, dtype=torch.bfloat16)
    return down, up


@pytest.mark.slow
def test_a_lora_with_a_huge_stray_tensor_is_refused_from_its_header(base, tmp_path):
    down, up = _adapter()
    m = "diffusion_model.blocks.0.attn.qkv_proj"
    lora = sparse_safetensors(tmp_path / "stray.safetensors", {
        f"{m}.lora_down.weight": ("BF16", list(down.shape)),
        f"{m}.lora_up.weight": ("BF16", list(up.shape)),
        "stray.weight": ("F32", [8 * GIB // 4]),  # 8 GiB of holes: past any cap used here
    })
    before = sha(lora) if os.path.getsize(lora) < GIB else None
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--lora", lora, "--to", "bf16",
              timeout=90)
    err = _quick(res, t0, code=1, budget=90)
    assert "stray.weight" in err and "no LoRA pair" in err
    assert before is None or sha(lora) == before


@pytest.mark.slow
def test_an_absurd_lora_rank_is_refused_from_its_header(base, tmp_path):
    m = "diffusion_model.blocks.0.attn.qkv_proj"
    rank = 1 << 20
    lora = sparse_safetensors(tmp_path / "rank.safetensors", {
        f"{m}.lora_down.weight": ("BF16", [rank, 512]),
        f"{m}.lora_up.weight": ("BF16", [1536, rank]),
    })
    t0 = time.monotonic()
    res = h3q("convert", base, tmp_path / "o.safetensors", "--lora", lora, timeout=90)
    err = _quick(res, t0, code=1, budget=90)
    assert f"rank {rank}" in err and str(limits.MAX_LORA_RANK) in err


def test_the_rank_limit_itself_is_accepted(tmp_path):
    from h3quant.h3 import lora as keys

    m = "diffusion_model.blocks.0.attn.qkv_proj"
    r = limits.MAX_LORA_RANK
    ads = keys.parse({f"{m}.lora_down.weight": (r, 512), f"{m}.lora_up.weight": (1536, r)})
    assert ads[0].rank == r


@pytest.mark.slow
def test_inputs_file_with_a_wrong_text_width_is_refused_before_reading(base, tmp_path):
    from h3quant.runtime.model import H3Model

    with H3Model.open(base, "cpu") as m:
        vc, ac, td = m.video_channels, m.audio_channels, m.text_dim
    wrong = 8 * GIB // 4 // 16  # 16 tokens x this width x 4 bytes = 8 GiB of holes
    assert wrong != td
    lat = sparse_safetensors(tmp_path / "lat.safetensors", {
        "video": ("F32", [1, vc, 1, 8, 8]), "audio": ("F32", [1, ac, 2, 8]),
        "text": ("F32", [1, 16, wrong])})
    t0 = time.monotonic()
    q = tmp_path / "q.safetensors"
    assert h3q("convert", base, q, "--no-report", timeout=120).returncode == 0
    res = h3q("verify", q, "--model", "--inputs", lat, "--device", "cpu", "--depth", "1",
              timeout=120)
    err = _quick(res, t0, code=2, budget=120)
    assert "text" in err and "dimension 2" in err


def test_recipe_json_is_read_through_the_bound(tmp_path):
    from h3quant.pipelines.convert.recipe import load_recipe

    p = tmp_path / "r.json"
    p.write_text(json.dumps({"rules": [{"layer": "blocks", "format": "bf16"}]}))
    assert load_recipe(p)[0].pattern == "blocks"


@pytest.mark.slow
def test_lora_fixture_is_still_baked(base, tmp_path):
    lora = tiny_lora(tmp_path / "l.safetensors")
    res = h3q("convert", base, tmp_path / "o.safetensors", "--lora", lora, "--to", "bf16",
              "--no-report", timeout=120)
    assert res.returncode == 0, res.stderr
