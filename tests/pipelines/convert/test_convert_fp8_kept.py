"""Converting an fp8 checkpoint (ComfyUI's fp8_scaled form: float8_e4m3fn codes, one
``scale_weight`` per layer, the legacy ``scaled_fp8`` marker) keeps the layers convert leaves
alone in float8, byte for byte, as per-layer float8 layers (``comfy_quant`` marker +
``weight_scale``). Every expectation is computed here from the source tensors (safetensors'
own reader, comfy-kitchen's fp8 dequantize), never from h3quant's tables. Synthetic tiny
checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.forge import cli
from helpers.fp8 import fp8_release
from safetensors import safe_open
from safetensors.torch import load_file, save_file


REFINER = "token_refiner.blocks.0.mlp.fc1"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8kept")
    made = fp8_release(root, seed=3)
    out = root / "int8.safetensors"
    res = cli("convert", made["fp8"], out)
    assert res.exit_code == 0, res.output
    return {**made, "out": out, "log": res.output}


def _raw(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(header metadata, name -> raw bytes), read with plain json + offsets (no h3quant)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    return meta, {k: data[base + v["data_offsets"][0]: base + v["data_offsets"][1]]
                  for k, v in header.items()}


def _dtypes(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _kept_layers(src: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n[: -len(".weight")] for n, t in src.items()
                  if n.startswith("token_refiner.") and t.dtype == torch.float8_e4m3fn)


def test_untouched_fp8_layers_keep_their_codes_and_scale(files):
    src = load_file(files["fp8"])
    _, src_raw = _raw(files["fp8"])
    meta, out_raw = _raw(files["out"])
    dtypes = _dtypes(files["out"])
    layers = _kept_layers(src)
    assert len(layers) == 8  # 2 refiner blocks x 4 linears
    table = json.loads(meta["_quantization_metadata"])["layers"]
    for layer in layers:
        assert dtypes[f"{layer}.weight"] == "F8_E4M3"
        assert out_raw[f"{layer}.weight"] == src_raw[f"{layer}.weight"], layer  # byte for byte
        scale = src[f"{layer}.scale_weight"].to(torch.float32).reshape(())
        assert dtypes[f"{layer}.weight_scale"] == "F32"
        got = torch.frombuffer(bytearray(out_raw[f"{layer}.weight_scale"]), dtype=torch.float32)
        assert got.numel() == 1 and torch.equal(got.reshape(()), scale)
        assert json.loads(out_raw[f"{layer}.comfy_quant"]) == {"format": "float8_e4m3fn"}
        assert table[layer] == {"format": "float8_e4m3fn"}
        assert f"{layer}.scale_weight" not in out_raw  # the legacy name is not written
    # the legacy marker: true in the source, not in the output (no layer there uses it)
    assert "scaled_fp8" in src_raw and "scaled_fp8" not in out_raw
    assert "kept in their float8 codes" in files["log"]


def test_kitchen_reads_the_kept_layer_as_the_source_decode(files):
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout

    src, out = load_file(files["fp8"]), load_file(files["out"])
    for layer in _kept_layers(src):
        want = src[f"{layer}.weight"].to(torch.float32) * src[f"{layer}.scale_weight"].float()
        params = TensorCoreFP8Layout.Params(scale=out[f"{layer}.weight_scale"],
                                            orig_dtype=torch.float32,
                                            orig_shape=tuple(out[f"{layer}.weight"].shape))
        got = TensorCoreFP8Layout.dequantize(out[f"{layer}.weight"], params)
        assert torch.equal(got, want), layer


def test_validate_is_clean_and_the_file_is_smaller_than_bf16(files, tmp_path):
    res = cli("validate", files["out"], "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["findings"] == [], doc["findings"]  # no T105 for the refiner kept in float8
    bf16 = tmp_path / "bf16_refiner.safetensors"
    res = cli("convert", files["fp8"], bf16, "--layer", r"token_refiner\.=bf16", "-q")
    assert res.exit_code == 0, res.output
    assert _dtypes(bf16)[f"{REFINER}.weight"] == "BF16"  # --layer still forces BF16
    assert files["out"].stat().st_size < bf16.stat().st_size


def test_per_row_scale_falls_back_to_bf16_and_says_so(files, tmp_path):
    t = load_file(files["fp8"])
    n = t[f"{REFINER}.weight"].shape[0]
    per_row = torch.linspace(0.5, 1.5, n, dtype=torch.float32) * t[f"{REFINER}.scale_weight"]
    t[f"{REFINER}.scale_weight"] = per_row
    with safe_open(str(files["fp8"]), "pt") as f:
        meta = f.metadata()
    src = tmp_path / "rows.safetensors"
    save_file(t, str(src), metadata=meta)
    out = tmp_path / "o.safetensors"
    res = cli("convert", src, out)
    assert res.exit_code == 0, res.output
    assert f"{REFINER}.weight: its fp8 scale is per row" in res.output
    got = load_file(out)
    want = (t[f"{REFINER}.weight"].float() * per_row[:, None]).to(torch.bfloat16)
    assert torch.equal(got[f"{REFINER}.weight"], want)
    assert f"{REFINER}.comfy_quant" not in got
    other = "token_refiner.blocks.0.mlp.fc2"
    assert got[f"{other}.weight"].dtype == torch.float8_e4m3fn  # the others are still kept


def test_lora_on_a_kept_fp8_layer_is_merged_in_float(files, tmp_path):
    src = load_file(files["fp8"])
    w = src[f"{REFINER}.weight"]
    n, k, rank, alpha, strength = w.shape[0], w.shape[1], 4, 2.0, 0.75
    g = torch.Generator().manual_seed(5)
    down = torch.randn(rank, k, generator=g) * 0.05
    up = torch.randn(n, rank, generator=g) * 0.05
    lora = tmp_path / "l.safetensors"
    module = f"diffusion_model.{REFINER}"
    save_file({f"{module}.lora_down.weight": down, f"{module}.lora_up.weight": up,
               f"{module}.alpha": torch.tensor(alpha)}, str(lora))
    out = tmp_path / "o.safetensors"
    res = cli("convert", files["fp8"], out, "--lora", f"{lora}:{strength}")
    assert res.exit_code == 0, res.output
    got = load_file(out)
    # ComfyUI's arithmetic: the fp32 decode (code x scale) plus the fp32 delta, rounded once
    base = w.to(torch.float32) * src[f"{REFINER}.scale_weight"].float()
    delta = (strength * alpha / rank) * torch.mm(up, down)
    want = (base + delta).to(torch.bfloat16)
    assert got[f"{REFINER}.weight"].dtype == torch.bfloat16
    diff = (got[f"{REFINER}.weight"].float() - want.float()).abs()
    assert torch.equal(got[f"{REFINER}.weight"], want), float((diff > 0).float().mean())
    assert f"{REFINER}.comfy_quant" not in got and f"{REFINER}.weight_scale" not in got
    other = "token_refiner.blocks.0.mlp.fc2"
    assert torch.equal(got[f"{other}.weight"].view(torch.uint8),
                       src[f"{other}.weight"].view(torch.uint8))  # untouched by the LoRA: kept
