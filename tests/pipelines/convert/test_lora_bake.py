"""``convert --lora``: baked weights checked against a merge written here, in numpy float64.

The expected weights are built in this file from the LoRA file's own keys with explicit loops
(which rows of the fused q/k/v each split adapter lands in, the SwiGLU halves swapped), never
from the product's key table.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from h3quant.cli import main as cli_main
from h3quant.errors import LoraError
from h3quant.h3.topology import config_for
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.synth import synth_checkpoint
from h3quant.synth.lora import write_lora

CFG = config_for("tiny", blocks=2)
QKV_THIRD = CFG.qkv_out // 3
FFN = CFG.fc1_out // 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    path = d / "b.safetensors"
    synth_checkpoint(path, preset="tiny", blocks=2, seed=11, workers=1)
    return path


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def _expected_delta(lora: dict[str, torch.Tensor], strength: float) -> dict[str, list]:
    """ComfyUI layer name -> [(rows, delta)], from the LoRA's keys (written for this test), in
    ComfyUI's arithmetic (comfy/weight_adapter/lora.py): ``up @ down`` in fp32 times
    ``strength * alpha / rank``, an fp32 delta per adapter, added to the weight in order."""
    out: dict[str, list] = {}

    def add(layer, rows, value):
        out.setdefault(layer, []).append((rows, value))

    for key in lora:
        for down_sfx, up_sfx in ((".lora_down.weight", ".lora_up.weight"),
                                 (".lora_A.weight", ".lora_B.weight")):
            if not key.endswith(down_sfx):
                continue
            module = key[: -len(down_sfx)]
            a, b = lora[key].float(), lora[module + up_sfx].float()
            rank = a.shape[0]
            alpha = float(lora[module + ".alpha"]) if module + ".alpha" in lora else rank
            d = ((strength * (alpha / rank)) * torch.mm(b, a)).numpy()
            if module.startswith("diffusion_model."):
                add(module[len("diffusion_model."):], slice(None), d)
            elif module.startswith("lora_unet_blocks_"):
                i, rest = module[len("lora_unet_blocks_"):].split("_", 1)
                sub = {"attn_qkv_proj": "attn.qkv_proj", "attn_out_proj": "attn.out_proj",
                       "mlp_fc1": "mlp.fc1", "mlp_fc2": "mlp.fc2"}[rest]
                add(f"blocks.{i}.{sub}", slice(None), d)
            else:  # transformer.blocks.N.<diffusers module>
                _, _, i, rest = module.split(".", 3)
                if rest in ("attn.to_q", "attn.to_k", "attn.to_v"):
                    part = "qkv".index(rest[-1])
                    add(f"blocks.{i}.attn.qkv_proj",
                        slice(part * QKV_THIRD, (part + 1) * QKV_THIRD), d)
                elif rest == "ff.net.0.proj":  # [value; gate] -> ComfyUI's [gate; value]
                    add(f"blocks.{i}.mlp.fc1", slice(None), np.concatenate([d[FFN:], d[:FFN]]))
                elif rest == "attn.to_out.0":
                    add(f"blocks.{i}.attn.out_proj", slice(None), d)
                elif rest == "ff.net.2":
                    add(f"blocks.{i}.mlp.fc2", slice(None), d)
                else:
                    raise AssertionError(module)
    return out


def _merged32(weight: torch.Tensor, parts) -> torch.Tensor:
    """The fp32 weight with each (rows, fp32 delta) added in order (ComfyUI's model patcher)."""
    w = weight.to(torch.float32, copy=True)
    for rows, d in parts:
        w[rows] += torch.from_numpy(np.ascontiguousarray(d))
    return w


def _expected_bf16(base_t, deltas_list):
    want = dict(base_t)
    parts: dict[str, list] = {}
    for deltas in deltas_list:
        for layer, ps in deltas.items():
            parts.setdefault(layer, []).extend(ps)
    for layer, ps in parts.items():
        want[layer + ".weight"] = _merged32(base_t[layer + ".weight"], ps).to(torch.bfloat16)
    return want


@pytest.mark.slow
@pytest.mark.parametrize("style", ["comfyui", "kohya", "diffusers"])
def test_bf16_bake_equals_the_independent_merge(base, tmp_path, style):
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, style, rank=4, scale=0.05, seed=2)
    out = tmp_path / "o.safetensors"
    convert(base, out, ConvertOptions(target="bf16", loras=(lora_path + ":0.75",), report=False))
    got, base_t = load_file(out), load_file(base)
    want = _expected_bf16(base_t, [_expected_delta(load_file(lora_path), 0.75)])
    assert set(got) == set(want)
    changed = [n for n in want if not torch.equal(want[n], base_t[n])]
    assert len(changed) == 8  # the 4 linears of both blocks
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_several_loras_and_negative_strength(base, tmp_path):
    a = write_lora(str(tmp_path / "a.safetensors"), CFG, "comfyui", rank=2, scale=0.05, seed=3)
    b = write_lora(str(tmp_path / "b.safetensors"), CFG, "diffusers", rank=3, scale=0.05, seed=4)
    out = tmp_path / "o.safetensors"
    convert(base, out, ConvertOptions(target="bf16", loras=(a + ":-0.5", b), report=False))
    want = _expected_bf16(load_file(base), [_expected_delta(load_file(a), -0.5),
                                             _expected_delta(load_file(b), 1.0)])
    got = load_file(out)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _tensor_bytes(path):
    from h3quant.formats.container.checkpoint import Checkpoint

    with Checkpoint(path) as ck:
        return {n: bytes(ck.read_bytes(n)) for n in ck.tensors}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["int8-convrot", "w4a8"])
def test_quantized_bake_equals_converting_the_baked_bf16_file(base, tmp_path, target):
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "kohya", rank=4, scale=0.05)
    merged = tmp_path / "merged.safetensors"
    convert(base, merged, ConvertOptions(target="bf16", loras=(lora_path,), report=False))
    ref, got = tmp_path / "ref.safetensors", tmp_path / "got.safetensors"
    convert(merged, ref, ConvertOptions(target=target, report=False))
    convert(base, got, ConvertOptions(target=target, loras=(lora_path,), report=False))
    # every tensor byte-identical; the header differs only in provenance (source, LoRA list)
    assert _tensor_bytes(got) == _tensor_bytes(ref)
    from h3quant.formats.container.checkpoint import Checkpoint

    with Checkpoint(got) as ck:
        opts = json.loads(ck.metadata["h3quant.options"])
    assert opts["lora"] == [["l.safetensors", 1.0]]


@pytest.mark.slow
def test_lora_onto_official_shards(base, tmp_path):
    """A diffusers LoRA onto the official release's shards: same bytes as onto ComfyUI's file."""
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "diffusers", rank=4, scale=0.05)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r = CliRunner().invoke(cli_main, ["synth", str(tmp_path / "a" / "h3"), "--seed", "11"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli_main, ["synth", str(tmp_path / "b" / "h3"), "--seed", "11",
                                      "--naming", "official"])
    assert r.exit_code == 0, r.output
    for d in "ab":
        convert(tmp_path / d / "h3", tmp_path / f"{d}.safetensors",
                ConvertOptions(target="int8-convrot", loras=(lora_path,), report=False))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.slow
def test_small_delta_into_w4a8_warns_and_int8_keeps_it(base, tmp_path):
    """A bf16 base decoded from W4A8 (every weight on W4A8's grid, as when a user has only the
    4-bit file): a small delta flips almost no 4-bit code, and the warning says so; int8's finer
    grid keeps most of it."""
    w4 = tmp_path / "w4.safetensors"
    convert(base, w4, ConvertOptions(target="w4a8", report=False))
    grid = tmp_path / "grid.safetensors"
    convert(w4, grid, ConvertOptions(target="bf16", report=False))
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "comfyui", rank=4, scale=0.02)
    rep = tmp_path / "r.json"
    r = CliRunner().invoke(cli_main, ["convert", str(grid), str(tmp_path / "w.safetensors"),
                                      "--to", "w4a8", "--lora", lora_path, "--report", str(rep)])
    assert r.exit_code == 0, r.output
    lora = json.loads(rep.read_text())["lora"]
    assert len(lora["warnings"]) == 8 and "warning:" in r.output and "int8-convrot" in r.output
    kept_w4a8 = {s["layer"]: s["kept"] for s in lora["survival"]}
    assert max(kept_w4a8.values()) < 0.1
    rep8 = convert(grid, tmp_path / "i.safetensors", ConvertOptions(loras=(lora_path,))).to_dict()
    assert rep8["lora"]["warnings"] == []
    for s in rep8["lora"]["survival"]:
        assert s["kept"] > 0.5 > kept_w4a8[s["layer"]]
        assert 0 < s["codes_changed"] <= 1


@pytest.mark.slow
def test_survival_is_measured_not_assumed(base, tmp_path):
    """kept near 1 for a large delta into int8; the delta norm equals the float64 one here."""
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "comfyui", rank=4, scale=0.08)
    rep = convert(base, tmp_path / "i.safetensors", ConvertOptions(loras=(lora_path,)))
    rows = {s["layer"]: s for s in rep.to_dict()["lora"]["survival"]}
    want = _expected_delta(load_file(lora_path), 1.0)
    for layer, parts in want.items():
        dense = sum(np.asarray(d, dtype=np.float64) for _, d in parts)  # one full-rows part each
        assert rows[layer]["delta_norm"] == pytest.approx(np.linalg.norm(dense), rel=1e-6)
        assert 0.8 < rows[layer]["kept"] < 1.2


@pytest.mark.slow
def test_unmatched_keys_are_an_error_unless_skipped(base, tmp_path):
    t = load_file(write_lora(str(tmp_path / "l.safetensors"), CFG, "comfyui", rank=2))
    t["diffusion_model.blocks.7.attn.qkv_proj.lora_down.weight"] = torch.zeros(2, CFG.hidden)
    t["diffusion_model.blocks.7.attn.qkv_proj.lora_up.weight"] = torch.zeros(CFG.qkv_out, 2)
    bad = tmp_path / "bad.safetensors"
    save_file(t, bad)
    out = tmp_path / "o.safetensors"
    r = CliRunner().invoke(cli_main, ["convert", str(base), str(out), "--lora", str(bad)])
    assert r.exit_code == 1 and "blocks.7.attn.qkv_proj" in r.output and not out.exists()
    r = CliRunner().invoke(cli_main, ["convert", str(base), str(out), "--lora", str(bad),
                                      "--lora-skip-unmatched"])
    assert r.exit_code == 0, r.output
    assert "skipped" in r.output and "blocks.7" in r.output


@pytest.mark.parametrize("keys,needle", [
    ({"diffusion_model.blocks.0.attn.qkv_proj.lokr_w1": (2, 4)}, "LoKr"),
    ({"diffusion_model.blocks.0.mlp.fc2.lora_down.weight": (2, 999),
      "diffusion_model.blocks.0.mlp.fc2.lora_up.weight": (512, 2)}, "does not fit"),
])
def test_bad_lora_files_exit_1_and_write_nothing(base, tmp_path, keys, needle):
    bad = tmp_path / "bad.safetensors"
    save_file({k: torch.zeros(s) for k, s in keys.items()}, bad)
    out = tmp_path / "o.safetensors"
    with pytest.raises(LoraError, match=needle):
        convert(base, out, ConvertOptions(loras=(str(bad),)))
    assert not out.exists()


@pytest.mark.slow
def test_int8_base_gives_the_codes_of_quantizing_the_merged_decode(base, tmp_path):
    """An int8 ConvRot base (group size 64): each touched layer decoded (by comfy-kitchen, here),
    merged in float64, quantized again by comfy-kitchen; the baked file holds those codes, and
    ``--to`` left out keeps the base's own format and group size."""
    ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
    q = tmp_path / "q.safetensors"
    convert(base, q, ConvertOptions(group_size=64, report=False))
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "diffusers", rank=4, scale=0.05)
    out = tmp_path / "o.safetensors"
    r = CliRunner().invoke(cli_main, ["convert", str(q), str(out), "--lora", lora_path,
                                      "--no-report"])
    assert r.exit_code == 0, r.output
    assert "int8-convrot, group size 64" in r.output
    qt, got = load_file(q), load_file(out)
    probe = ck_tensor.QuantizedTensor.from_float(torch.zeros(1, 64), "TensorWiseINT8Layout",
                                                 per_channel=True, convrot=True,
                                                 convrot_groupsize=64)
    deltas = _expected_delta(load_file(lora_path), 1.0)
    assert len(deltas) == 8
    for layer, d in deltas.items():
        codes, scale = qt[layer + ".weight"], qt[layer + ".weight_scale"]
        params = type(probe._params)(scale=scale, orig_dtype=torch.float32,
                                     orig_shape=tuple(codes.shape), is_weight=True, convrot=True,
                                     convrot_groupsize=64, transposed=False)
        decoded = ck_tensor.QuantizedTensor(codes, "TensorWiseINT8Layout", params).dequantize()
        merged = _merged32(decoded.float(), d)
        ref = ck_tensor.QuantizedTensor.from_float(merged, "TensorWiseINT8Layout",
                                                   per_channel=True, convrot=True,
                                                   convrot_groupsize=64)
        assert torch.equal(got[layer + ".weight"], ref._qdata), layer
        assert torch.equal(got[layer + ".weight_scale"], ref._params.scale.reshape(-1, 1)), layer
    untouched = [n for n in qt if not any(n.startswith(lay + ".") for lay in deltas)]
    for name in untouched:
        assert torch.equal(got[name], qt[name]), name


@pytest.mark.slow
def test_w4a8_base_bakes_and_validates(base, tmp_path):
    w4 = tmp_path / "w4.safetensors"
    convert(base, w4, ConvertOptions(target="w4a8", report=False))
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "kohya", rank=4, scale=0.05)
    out = tmp_path / "o.safetensors"
    r = CliRunner().invoke(cli_main, ["convert", str(w4), str(out), "--lora", lora_path])
    assert r.exit_code == 0, r.output
    assert "w4a8" in r.output
    r = CliRunner().invoke(cli_main, ["validate", "--deep", str(out)])
    assert r.exit_code == 0, r.output


def test_dry_run_lists_the_lora_layers(base, tmp_path):
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "diffusers", rank=2)
    r = CliRunner().invoke(cli_main, ["convert", str(base), str(tmp_path / "o.safetensors"),
                                      "--lora", lora_path, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert plan["lora"]["layers"] == sorted(f"blocks.{i}.{s}" for i in range(2) for s in
                                            ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"))
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.slow
def test_bake_is_deterministic_and_leaves_inputs_alone(base, tmp_path):
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "diffusers", rank=4, scale=0.05)
    before = (base.read_bytes(), (tmp_path / "l.safetensors").read_bytes())
    for name in ("a", "b"):
        convert(base, tmp_path / f"{name}.safetensors",
                ConvertOptions(target="w4a8", loras=(lora_path + ":0.3",), workers=2))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert (base.read_bytes(), (tmp_path / "l.safetensors").read_bytes()) == before


@pytest.mark.slow
def test_lora_onto_fp8_merges_into_the_exact_decode(tmp_path):
    """A scaled-fp8 base: code x scale in fp32 (as the loader multiplies it) + the delta in
    float64, rounded once to BF16 (not the BF16-rounded decode plus the delta)."""
    src = tmp_path / "f8.safetensors"
    r = CliRunner().invoke(cli_main, ["synth", str(src), "--dtype", "fp8", "--seed", "5"])
    assert r.exit_code == 0, r.output
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "comfyui", rank=4, scale=0.05)
    out = tmp_path / "o.safetensors"
    convert(src, out, ConvertOptions(target="bf16", loras=(lora_path,), report=False))
    f8, got = load_file(src), load_file(out)
    for layer, d in _expected_delta(load_file(lora_path), 1.0).items():
        codes, scale = f8[layer + ".weight"], f8[layer + ".scale_weight"]
        assert codes.dtype == torch.float8_e4m3fn
        decoded = codes.float() * scale.float().reshape(())
        want = _merged32(decoded, d).to(torch.bfloat16)
        assert torch.equal(got[layer + ".weight"], want), layer


@pytest.mark.slow
def test_lora_promote_writes_the_touched_layers_int8(base, tmp_path):
    """W4A8 file, LoRA on block 0 only, --lora-promote int8-convrot: block 0's linears int8
    (the delta kept, no warning), block 1 W4A8; the markers say so."""
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.markers import parse_header_metadata

    w4 = tmp_path / "w4.safetensors"
    convert(base, w4, ConvertOptions(target="w4a8", report=False))
    grid = tmp_path / "grid.safetensors"
    convert(w4, grid, ConvertOptions(target="bf16", report=False))
    lora_path = write_lora(str(tmp_path / "l.safetensors"), CFG, "comfyui", rank=4, scale=0.02,
                           blocks=1)
    out = tmp_path / "o.safetensors"
    rep = convert(grid, out, ConvertOptions(target="w4a8", loras=(lora_path,),
                                            lora_promote="int8-convrot")).to_dict()
    assert rep["lora"]["warnings"] == []
    assert all(s["kept"] > 0.5 for s in rep["lora"]["survival"])
    with Checkpoint(out) as ck:
        formats = {k: v["format"] for k, v in parse_header_metadata(ck.metadata).items()}
    for sub in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
        assert formats[f"blocks.0.{sub}"] == "int8_tensorwise"
        assert formats[f"blocks.1.{sub}"] == "asym_w4a8_int8"
    r = CliRunner().invoke(cli_main, ["convert", str(grid), str(tmp_path / "x.safetensors"),
                                      "--lora-promote", "int8-convrot"])
    assert r.exit_code == 2 and "needs --lora" in r.output
