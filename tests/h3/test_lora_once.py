"""One adapter, applied once: a LoRA file holding the same adapters under two key spellings
(ComfyUI + bare keys, ComfyUI + kohya keys, a fused to_qkv beside a split to_q) is refused with
a message naming both keys, never merged twice. ComfyUI's loader would keep only one of the two
(its key map assigns each model weight once), so h3quant does not guess which was meant."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from hostile_util import sha, tiny_base, tiny_lora
from safetensors.torch import load_file, save_file

from h3quant.cli import main
from h3quant.errors import LoraError
from h3quant.h3 import lora as keys


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("once")
    return {"dir": d, "base": tiny_base(d / "base.safetensors"),
            "lora": load_file(str(tiny_lora(d / "lora.safetensors")))}


def _respell(t: dict, style: str) -> dict:
    """The same tensors under bare keys, or kohya's (lora_unet_ + the module with underscores)."""
    out = {}
    for k, v in t.items():
        bare = k[len("diffusion_model."):]
        if style == "bare":
            out[bare] = v.clone()
            continue
        for tail in (".lora_down.weight", ".lora_up.weight", ".alpha"):
            if bare.endswith(tail):
                out["lora_unet_" + bare[: -len(tail)].replace(".", "_") + tail] = v.clone()
    return out


@pytest.mark.parametrize("style", ["bare", "kohya"])
def test_two_spellings_of_one_adapter_are_refused(env, style):
    both = {**env["lora"], **_respell(env["lora"], style)}
    assert len(both) == 2 * len(env["lora"])
    path = env["dir"] / f"twice_{style}.safetensors"
    save_file(both, str(path))
    before = sha(path)
    out = env["dir"] / f"o_{style}.safetensors"
    res = CliRunner().invoke(main, ["convert", str(env["base"]), str(out), "--lora", str(path),
                                    "--to", "bf16", "--no-report"])
    assert res.exit_code == 1, res.output
    assert "targeted twice" in res.output and "diffusion_model.blocks.0" in res.output
    assert not out.exists() and sha(path) == before


def test_each_spelling_alone_is_baked_and_equal(env):
    outs = []
    for style in ("comfy", "bare", "kohya"):
        t = env["lora"] if style == "comfy" else _respell(env["lora"], style)
        p = env["dir"] / f"one_{style}.safetensors"
        save_file(t, str(p))
        out = env["dir"] / f"baked_{style}.safetensors"
        res = CliRunner().invoke(main, ["convert", str(env["base"]), str(out), "--lora", str(p),
                                        "--to", "bf16", "--no-report", "-q"])
        assert res.exit_code == 0, res.output
        outs.append(load_file(str(out)))
    for name, x in outs[0].items():
        assert torch.equal(x, outs[1][name]) and torch.equal(x, outs[2][name]), name


def test_a_fused_qkv_beside_a_split_q_is_refused():
    base = {"blocks.0.attn.qkv_proj.weight": (96, 32)}
    shapes = {"transformer.transformer_blocks.0.attn.to_qkv.lora_A.weight": (2, 32),
              "transformer.transformer_blocks.0.attn.to_qkv.lora_B.weight": (96, 2),
              "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": (2, 32),
              "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": (32, 2)}
    adapters = keys.parse(shapes)
    with pytest.raises(LoraError, match="to_q.*to_qkv|to_qkv.*to_q"):
        keys.resolve(adapters, base)


def test_two_loras_on_one_layer_still_add():
    """Separate --lora files on one layer are intended (each applied once): not refused."""
    base = {"blocks.0.attn.qkv_proj.weight": (96, 32)}
    shapes = {"diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": (2, 32),
              "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight": (96, 2)}
    targets, _ = keys.resolve(keys.parse(shapes), base)
    assert len(targets) == 1
