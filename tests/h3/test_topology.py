"""H3 topology: expected tensors, detection (float / int8 / W4A8, header only), topology findings."""

from types import SimpleNamespace

import pytest

from h3quant.errors import UnsupportedError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.h3.topology import (
    PRESETS,
    block_linear_names,
    check,
    config_for,
    detect,
    expected_tensors,
    is_h3_block_linear,
    summary,
)
from h3quant.synth import synth_checkpoint

INT8 = "int8_tensorwise"
W4A8 = "asym_w4a8_int8"


def _header(cfg, prefix=""):
    """A header-only tensor dict (no data) with the plain checkpoint of ``cfg``."""
    return {n: SimpleNamespace(dtype=d, shape=s) for n, (d, s) in expected_tensors(cfg, prefix).items()}


def _quantize(tensors, layers, fmt):
    """Replace each layer's float weight by the header entries of a quantized one."""
    for layer in layers:
        n, k = tensors[f"{layer}.weight"].shape
        if fmt == INT8:
            tensors[f"{layer}.weight"] = SimpleNamespace(dtype="I8", shape=(n, k))
            tensors[f"{layer}.weight_scale"] = SimpleNamespace(dtype="F32", shape=(n, 1))
        else:
            tensors[f"{layer}.weight"] = SimpleNamespace(dtype="I8", shape=(n, k // 2))
            tensors[f"{layer}.weight_s_rel"] = SimpleNamespace(dtype="F8_E4M3", shape=(n, k // 16))
            tensors[f"{layer}.weight_s_channel"] = SimpleNamespace(dtype="F32", shape=(n,))
        tensors[f"{layer}.comfy_quant"] = SimpleNamespace(dtype="U8", shape=(72,))
    return {layer: fmt for layer in layers}


def _codes(findings):
    return sorted(f.code for f in findings)


def test_full_dims_match_formats_md_section_5():
    for form in ("pruned", "full"):
        cfg = config_for("full", form=form)
        t = expected_tensors(cfg)
        for i in (0, 17, 49):
            b = f"blocks.{i}"
            assert t[f"{b}.attn.qkv_proj.weight"] == ("BF16", (21504, 5376))
            assert t[f"{b}.attn.out_proj.weight"] == ("BF16", (5376, 7168))
            assert t[f"{b}.mlp.fc1.weight"] == ("BF16", (28672, 5376))
            assert t[f"{b}.mlp.fc2.weight"] == ("BF16", (5376, 14336))
            assert t[f"{b}.norm1.weight"][1] == t[f"{b}.norm2.weight"][1] == (5376,)
            assert t[f"{b}.attn.q_norm.weight"][1] == t[f"{b}.attn.k_norm.weight"][1] == (128,)
            tdim = 8 if form == "pruned" else 2688
            assert t[f"{b}.adaln_proj.linear.weight"] == ("BF16", (96768, tdim))
            assert t[f"{b}.adaln_proj.linear.bias"] == ("BF16", (96768,))
            for sub in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
                assert f"{b}.{sub}.bias" not in t  # no bias on the block linears
        assert "blocks.50.norm1.weight" not in t
        assert t["video_patch_proj.weight"] == ("F32", (5376, 96))
        assert t["video_patch_proj.bias"] == ("F32", (5376,))
        assert t["audio_patch_proj.weight"] == ("F32", (5376, 32))
        assert t["audio_patch_proj.bias"] == ("F32", (5376,))
        assert t["condition_proj.weight"] == ("BF16", (5376, 5120))
        assert t["condition_proj.bias"] == ("BF16", (5376,))
        assert t["rope.inv_freq"] == ("F32", (16,))
        assert t["final_layer.video_out.weight"] == ("F32", (96, 5376))
        assert t["final_layer.video_out.bias"] == ("F32", (96,))
        assert t["final_layer.audio_out.weight"] == ("F32", (32, 5376))
        assert t["final_layer.audio_out.bias"] == ("F32", (32,))
        assert "final_layer.norm.weight" in t and "final_layer.adaln_proj.linear.weight" in t
        assert {f"token_refiner.blocks.{j}.attn.qkv_proj.weight" for j in (0, 1)} <= set(t)
        assert not any(n.startswith("token_refiner.blocks.2.") for n in t)
        if form == "pruned":
            assert t["adaln_t_table"] == ("F32", (1025, 8))
            assert not any(n.startswith("time_embedder.") for n in t)
        else:
            assert "adaln_t_table" not in t
            assert t["time_embedder.proj_in.weight"][1][0] == 2688
            assert t["time_embedder.proj_out.weight"][1] == (2688, 2688)
            assert "time_embedder.proj_in.bias" in t and "time_embedder.proj_out.bias" in t


def test_presets_and_block_linears():
    full = config_for("full")
    assert (full.attn_width, full.adaln_out, full.blocks) == (7168, 96768, 50)
    tiny = config_for("tiny", blocks=3, form="full")
    assert tiny.blocks == 3 and tiny.form == "full" and tiny.t_dim != 8
    for k in (tiny.hidden, tiny.attn_width, tiny.ffn):
        assert k % 256 == 0
    names = block_linear_names(full)
    assert len(names) == 200 == len(set(names))
    assert names[:4] == ["blocks.0.attn.qkv_proj", "blocks.0.attn.out_proj", "blocks.0.mlp.fc1",
                         "blocks.0.mlp.fc2"]
    assert all(is_h3_block_linear(n) for n in names)
    assert is_h3_block_linear("model.diffusion_model.blocks.12.mlp.fc2")
    for bad in ("token_refiner.blocks.0.attn.qkv_proj", "model.token_refiner.blocks.1.mlp.fc1",
                "blocks.0.adaln_proj.linear", "blocks.0.attn.qkv_proj.weight", "double_blocks.0.mlp.fc1",
                "condition_proj", "blocks.x.mlp.fc1"):
        assert not is_h3_block_linear(bad), bad
    with pytest.raises(UnsupportedError):
        config_for("huge")
    with pytest.raises(UnsupportedError):
        config_for("tiny", form="half")
    with pytest.raises(UnsupportedError):
        config_for("tiny", blocks=0)


@pytest.mark.parametrize("form", ["pruned", "full"])
def test_detect_synth_tiny(tmp_path, form):
    path = tmp_path / "h3.safetensors"
    synth_checkpoint(path, preset="tiny", blocks=3, form=form, seed=1)
    with Checkpoint(path) as ck:
        det = detect(ck.tensors)
        assert det is not None
        assert (det.preset_name, det.form, det.blocks, det.prefix) == ("tiny", form, 3, "")
        assert det.config == config_for("tiny", blocks=3, form=form)
        assert check(ck.tensors, det, {}) == []
        s = summary(det, {})
        assert s["block_linears"] == {"total": 12, "quantized": 0, "formats": {}}


@pytest.mark.parametrize("form", ["pruned", "full"])
def test_detect_full_header_only(form):
    cfg = config_for("full", form=form)
    det = detect(_header(cfg))
    assert det.config == cfg
    assert (det.preset_name, det.form, det.blocks) == ("full", form, 50)
    assert det.config.heads == 56 and det.config.t_dim == (8 if form == "pruned" else 2688)
    assert check(_header(cfg), det, {}) == []


@pytest.mark.parametrize("fmt", [INT8, W4A8])
def test_detect_quantized_layers(fmt):
    cfg = config_for("full", blocks=4)
    tensors = _header(cfg)
    quant = _quantize(tensors, block_linear_names(cfg), fmt)
    det = detect(tensors)
    assert det.config == cfg and det.preset_name == "full"
    assert check(tensors, det, quant) == []
    s = summary(det, quant)
    assert s["block_linears"] == {"total": 16, "quantized": 16, "formats": {fmt: 16}}
    assert s["other_quantized"] == 0


def test_w4a8_without_marker_info_uses_s_rel():
    cfg = config_for("tiny")
    tensors = _header(cfg)
    _quantize(tensors, ["blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2"], W4A8)
    assert detect(tensors).config == cfg  # logical K = 2 * stored K
    assert check(tensors, detect(tensors), None) == []


def test_custom_config_and_prefix():
    cfg = config_for("tiny", blocks=2)
    custom = type(cfg)(**{**cfg.__dict__, "hidden": 768, "ffn": 2048, "heads": 6})
    det = detect(_header(custom, "model.diffusion_model."))
    assert det.preset_name == "custom" and det.prefix == "model.diffusion_model."
    assert (det.config.hidden, det.config.heads, det.config.ffn) == (768, 6, 2048)
    # the prefix is a note (ComfyUI strips it on load), nothing else
    assert [f.code for f in check(_header(custom, "model.diffusion_model."), det, {})] == ["T110"]


def test_not_h3():
    tensors = {"model.layers.0.mlp.weight": SimpleNamespace(dtype="BF16", shape=(4, 4))}
    assert detect(tensors) is None
    assert detect({"token_refiner.blocks.0.attn.qkv_proj.weight":
                   SimpleNamespace(dtype="BF16", shape=(1536, 512))}) is None
    assert _codes(check(tensors, None)) == ["T104"]
    assert summary(None) == {"detected": False}


def test_check_missing_block_in_the_middle():
    cfg = config_for("full")
    tensors = {n: i for n, i in _header(cfg).items() if not n.startswith("blocks.17.")}
    det = detect(tensors)
    assert det.blocks == 50 and any("17" in note for note in det.notes)
    found = check(tensors, det, {})
    assert _codes(found) == ["T101"]
    assert found[0].tensor == "blocks.17" and found[0].severity.value == "error"


def test_check_missing_wrong_extra_and_unexpected_quantized():
    cfg = config_for("tiny", blocks=3)
    tensors = _header(cfg)
    del tensors["blocks.1.attn.k_norm.weight"]
    tensors["blocks.2.mlp.fc2.weight"] = SimpleNamespace(dtype="BF16", shape=(512, 1000))
    tensors["blocks.0.attn.qkv_proj.bias"] = SimpleNamespace(dtype="BF16", shape=(1536,))
    tensors["lora.up.weight"] = SimpleNamespace(dtype="BF16", shape=(8, 512))
    quant = _quantize(tensors, ["token_refiner.blocks.0.mlp.fc1", "blocks.0.mlp.fc1"], INT8)
    det = detect(tensors)
    found = check(tensors, det, quant)
    by_code = {}
    for f in found:
        by_code.setdefault(f.code, []).append(f.tensor)
    assert by_code["T101"] == ["blocks.1.attn.k_norm.weight"]
    assert by_code["T102"] == ["blocks.2.mlp.fc2.weight"]
    # a bias H3's linear lacks (the forward would add it) is a warning; a tensor outside H3's
    # layers, which ComfyUI and h3quant ignore, a note
    assert by_code["T103"] == ["blocks.0.attn.qkv_proj.bias"]
    assert by_code["T108"] == ["lora.up.weight"]
    assert by_code["T105"] == ["token_refiner.blocks.0.mlp.fc1"]
    assert set(by_code) == {"T101", "T102", "T103", "T105", "T108"}
    s = summary(det, quant)
    assert s["block_linears"]["quantized"] == 1 and s["other_quantized"] == 1


def test_check_packed_weight_with_wrong_k():
    cfg = config_for("tiny")
    tensors = _header(cfg)
    quant = _quantize(tensors, ["blocks.1.mlp.fc1"], W4A8)
    tensors["blocks.1.mlp.fc1.weight"] = SimpleNamespace(dtype="I8", shape=(2048, 512))  # K 1024
    found = check(tensors, detect(tensors), quant)
    assert _codes(found) == ["T102"]
    assert "[2048, 1024]" in found[0].message and "stored [2048, 512]" in found[0].message


def test_presets_table_is_consistent():
    for name in PRESETS:
        for form in ("pruned", "full"):
            cfg = config_for(name, form=form)
            det = detect(_header(cfg))
            assert det.preset_name == name and det.config == cfg


def test_float8_layer_outside_the_blocks_is_not_flagged():
    """ComfyUI's fp8_scaled releases store every linear (the token refiner too) as a per-tensor
    float8 layer, and convert keeps such layers: no T105 for them; int8 there still is one."""
    cfg = config_for("tiny", blocks=2)
    tensors = _header(cfg)
    quant = {}
    for layer in ("token_refiner.blocks.0.mlp.fc1", "token_refiner.blocks.0.mlp.fc2"):
        n, k = tensors[f"{layer}.weight"].shape
        tensors[f"{layer}.weight"] = SimpleNamespace(dtype="F8_E4M3", shape=(n, k))
        tensors[f"{layer}.weight_scale"] = SimpleNamespace(dtype="F32", shape=())
        tensors[f"{layer}.comfy_quant"] = SimpleNamespace(dtype="U8", shape=(28,))
        quant[layer] = "float8_e4m3fn"
    quant.update(_quantize(tensors, ["token_refiner.blocks.1.mlp.fc1"], INT8))
    found = check(tensors, detect(tensors), quant)
    assert [(f.code, f.tensor) for f in found] == [("T105", "token_refiner.blocks.1.mlp.fc1")]
