"""LoRA key styles and merge, checked against an independent numpy merge written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from h3quant.errors import UnsupportedError
from h3quant.h3 import lora as lk
from h3quant.h3.topology import config_for, expected_tensors
from h3quant.pipelines.convert import lora as lm

CFG = config_for("tiny", blocks=2)
BASE = {k: s for k, (_, s) in expected_tensors(CFG).items()}
F = CFG.ffn
A3 = CFG.attn_width


def _pair(rng, n, k, r):
    return (rng.standard_normal((r, k)).astype(np.float32),
            rng.standard_normal((n, r)).astype(np.float32))


def _write(path, tensors):
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, path)
    return str(path)


def _base_weights(rng):
    return {k[:-7]: rng.standard_normal(s).astype(np.float32)
            for k, s in BASE.items() if k.endswith(".weight") and len(s) == 2}


def _merge_all(ls, weights):
    return {name: ls.merged(name, torch.from_numpy(w), torch.float64).numpy() if name in ls.layers else w
            for name, w in weights.items()}


def test_comfy_fused_qkv_and_adaln_with_alpha(tmp_path):
    rng = np.random.default_rng(0)
    a, b = _pair(rng, 3 * A3, CFG.hidden, 4)
    a2, b2 = _pair(rng, 18 * CFG.hidden, CFG.t_dim, 2)
    path = _write(tmp_path / "c.safetensors", {
        "diffusion_model.blocks.1.attn.qkv_proj.lora_down.weight": a,
        "diffusion_model.blocks.1.attn.qkv_proj.lora_up.weight": b,
        "diffusion_model.blocks.1.attn.qkv_proj.alpha": np.array(12.0, np.float32),
        "diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight": a2,
        "diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight": b2,
    })
    w = _base_weights(rng)
    got = _merge_all(lm.load([path + ":0.5"], BASE), w)
    want = w["blocks.1.attn.qkv_proj"] + 0.5 * (12.0 / 4) * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got["blocks.1.attn.qkv_proj"], want, rtol=1e-5, atol=1e-4)
    want2 = w["blocks.0.adaln_proj.linear"] + 0.5 * 1.0 * (b2.astype(np.float64) @ a2)
    np.testing.assert_allclose(got["blocks.0.adaln_proj.linear"], want2, rtol=1e-5, atol=1e-4)
    assert np.array_equal(got["blocks.0.attn.qkv_proj"], w["blocks.0.attn.qkv_proj"])


def test_kohya_names_include_refiner(tmp_path):
    rng = np.random.default_rng(1)
    a, b = _pair(rng, CFG.hidden, CFG.ffn, 3)
    path = _write(tmp_path / "k.safetensors", {
        "lora_unet_token_refiner_blocks_1_mlp_fc2.lora_down.weight": a,
        "lora_unet_token_refiner_blocks_1_mlp_fc2.lora_up.weight": b,
        "lora_unet_token_refiner_blocks_1_mlp_fc2.alpha": np.array([1.5], np.float32),
    })
    w = _base_weights(rng)
    got = _merge_all(lm.load([path + ":-2"], BASE), w)
    name = "token_refiner.blocks.1.mlp.fc2"
    want = w[name] - 2.0 * (1.5 / 3) * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-4)
    assert np.array_equal(got["blocks.1.mlp.fc2"], w["blocks.1.mlp.fc2"])


@pytest.mark.slow
def test_diffusers_split_qkv_and_swiglu_order(tmp_path):
    rng = np.random.default_rng(2)
    t = {}
    parts = {}
    for p in ("q", "k", "v"):
        parts[p] = _pair(rng, A3, CFG.hidden, 2)
        t[f"transformer.blocks.0.attn.to_{p}.lora_A.weight"] = parts[p][0]
        t[f"transformer.blocks.0.attn.to_{p}.lora_B.weight"] = parts[p][1]
    fa, fb = _pair(rng, 2 * F, CFG.hidden, 2)  # rows [value; gate]
    t["transformer.blocks.0.ff.net.0.proj.lora_A.weight"] = fa
    t["transformer.blocks.0.ff.net.0.proj.lora_B.weight"] = fb
    path = _write(tmp_path / "d.safetensors", t)
    w = _base_weights(rng)
    got = _merge_all(lm.load([path], BASE), w)
    want = w["blocks.0.attn.qkv_proj"].astype(np.float64).copy()
    for i, p in enumerate("qkv"):
        a, b = parts[p]
        want[i * A3:(i + 1) * A3] += b.astype(np.float64) @ a
    np.testing.assert_allclose(got["blocks.0.attn.qkv_proj"], want, rtol=1e-5, atol=1e-4)
    delta = fb.astype(np.float64) @ fa
    value, gate = delta[:F], delta[F:]
    want_fc1 = w["blocks.0.mlp.fc1"].astype(np.float64).copy()
    want_fc1[:F] += gate  # ComfyUI fc1 rows: [gate | up]
    want_fc1[F:] += value
    np.testing.assert_allclose(got["blocks.0.mlp.fc1"], want_fc1, rtol=1e-5, atol=1e-4)


def test_several_loras_in_order(tmp_path):
    rng = np.random.default_rng(3)
    a1, b1 = _pair(rng, CFG.hidden, A3, 2)
    a2, b2 = _pair(rng, CFG.hidden, A3, 5)
    p1 = _write(tmp_path / "1.safetensors", {"diffusion_model.blocks.1.attn.out_proj.lora_A.weight": a1,
                                              "diffusion_model.blocks.1.attn.out_proj.lora_B.weight": b1})
    p2 = _write(tmp_path / "2.safetensors", {"transformer.blocks.1.attn.to_out.0.lora_A.weight": a2,
                                              "transformer.blocks.1.attn.to_out.0.lora_B.weight": b2})
    w = _base_weights(rng)
    got = _merge_all(lm.load([p1 + ":0.25", p2 + ":1.5"], BASE), w)
    want = (w["blocks.1.attn.out_proj"] + 0.25 * (b1.astype(np.float64) @ a1)
            + 1.5 * (b2.astype(np.float64) @ a2))
    np.testing.assert_allclose(got["blocks.1.attn.out_proj"], want, rtol=1e-5, atol=1e-4)


def test_bf16_bake_is_bit_exact_to_independent_merge(tmp_path):
    """ComfyUI's arithmetic (fp32 up @ down, scaled, added to the fp32 weight, rounded once);
    tests/pipelines/convert/test_lora_comfy_merge.py covers several adapters, alphas and row blocks."""
    rng = np.random.default_rng(4)
    a, b = _pair(rng, CFG.hidden, CFG.ffn, 4)
    path = _write(tmp_path / "c.safetensors", {"diffusion_model.blocks.0.mlp.fc2.lora_down.weight": a,
                                                "diffusion_model.blocks.0.mlp.fc2.lora_up.weight": b})
    w = torch.randn(CFG.hidden, CFG.ffn, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = lm.load([path], BASE).merged("blocks.0.mlp.fc2", w, torch.bfloat16)
    want = w.float() + 1.0 * torch.mm(torch.from_numpy(b), torch.from_numpy(a))
    assert torch.equal(got, want.bfloat16())  # rounded once


@pytest.mark.parametrize("keys,needle", [
    ({"diffusion_model.blocks.0.attn.qkv_proj.hada_w1_a": (2, 4)}, "LoHa"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.lokr_w1": (2, 4)}, "LoKr"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.dora_scale": (1, 512)}, "DoRA"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": (2, 512)}, "no matching"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight": (2, 512),
      "diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight": (1536, 2),
      "diffusion_model.blocks.0.attn.qkv_proj.extra": (3,)}, "belong to no LoRA pair"),
])
def test_bad_files_name_the_keys(keys, needle):
    with pytest.raises(UnsupportedError, match=needle):
        lk.parse(keys)


def test_unmatched_and_misfit_are_errors_unless_skipped(tmp_path):
    rng = np.random.default_rng(5)
    a, b = _pair(rng, 8, 8, 2)
    path = _write(tmp_path / "u.safetensors", {"diffusion_model.blocks.7.attn.qkv_proj.lora_A.weight": a,
                                                "diffusion_model.blocks.7.attn.qkv_proj.lora_B.weight": b})
    with pytest.raises(UnsupportedError, match="blocks.7.attn.qkv_proj"):
        lm.load([path], BASE)
    assert lm.load([path], BASE, skip_unmatched=True).entries == []
    path2 = _write(tmp_path / "m.safetensors", {"diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": a,
                                                 "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": b})
    with pytest.raises(UnsupportedError, match="shape mismatch.*blocks.0.attn.qkv_proj"):
        lm.load([path2], BASE)


def test_spec_parsing():
    assert lm.parse_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert lm.parse_spec("a.safetensors:-0.5") == ("a.safetensors", -0.5)
    assert lm.parse_spec("C:/x/a.safetensors") == ("C:/x/a.safetensors", 1.0)


def test_describe_styles():
    ads = lk.parse({"lora_unet_blocks_0_mlp_fc1.lora_down.weight": (4, 512),
                    "lora_unet_blocks_0_mlp_fc1.lora_up.weight": (2048, 4),
                    "transformer.blocks.0.attn.to_q.lora_A.weight": (2, 512),
                    "transformer.blocks.0.attn.to_q.lora_B.weight": (512, 2)})
    d = lk.describe(ads)
    assert d["styles"] == ["diffusers", "kohya"] and d["ranks"] == [2, 4]


@pytest.mark.parametrize("style", ["comfyui", "kohya", "diffusers"])
def test_synth_lora_styles_resolve_and_inspect(tmp_path, style):
    from click.testing import CliRunner

    from h3quant.cli import main
    from h3quant.synth.lora import write_lora

    path = write_lora(str(tmp_path / f"{style}.safetensors"), CFG, style, rank=4)
    ls = lm.load([path], BASE)
    assert ls.layers == {f"blocks.{i}.{s}" for i in range(2)
                         for s in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    res = CliRunner().invoke(main, ["inspect", path])
    assert res.exit_code == 0, res.output
    assert f"style(s): {style}" in res.output and "blocks.1.mlp.fc2" in res.output
