"""Loader (exact quantized data, marker resolution, refusals of what cannot run as stored) and the minimal H3 block."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from h3quant.errors import FormatError, H3QuantError, MarkerError, UnsupportedError, VerifyError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.markers import HEADER_KEY, marker_tensor
from h3quant.formats.container.writer import save_tensors
from h3quant.runtime.model.block import attention, reference_block, rms_norm, runtime_block
from h3quant.formats.layers import scan_checkpoint
from h3quant.runtime.loader import BLOCK_LINEARS, block_indices, load_blocks, load_layer
from helpers.h3files import read_tensors, rewrite, set_header_layer

@pytest.fixture(scope="module")
def files(tiny_files):
    return tiny_files


QKV = "blocks.0.attn.qkv_proj"


# ------------------------------------------------------------------------- loader: exact data


@pytest.mark.parametrize("mmap", [True, False])
def test_quantized_bytes_and_scales_are_bit_identical_to_the_file(files, mmap):
    blk = load_blocks(files["int8"], [0], mmap=mmap)[0]
    with Checkpoint(files["int8"], mmap=False) as ck:
        for sub in BLOCK_LINEARS:
            lay = blk.linear(sub)
            name = f"blocks.0.{sub}"
            assert lay.is_quantized and lay.format.value == "int8_tensorwise"
            assert set(lay.tensors) == {"weight", "weight_scale"}  # marker filtered out
            assert lay.weight.dtype == torch.int8
            assert lay.weight.numpy().tobytes() == bytes(ck.read_bytes(name + ".weight"))
            assert lay.tensors["weight_scale"].numpy().tobytes() == \
                bytes(ck.read_bytes(name + ".weight_scale"))
            # what the runtime layer is built from is the stored data, unchanged
            q, s = lay.runtime_tensors()
            assert q.numpy().tobytes() == bytes(ck.read_bytes(name + ".weight"))
            assert s.numpy().tobytes() == bytes(ck.read_bytes(name + ".weight_scale"))


def test_runtime_layer_keeps_stored_codes_and_scales(files):
    blk = load_blocks(files["int8"], [0])[0]
    rt = runtime_block(blk, device="cpu")
    for sub, mod in rt.linears().items():
        lay = blk.linear(sub)
        assert torch.equal(mod.weight, lay.weight)
        assert torch.equal(mod.weight_scale.reshape(-1).view(torch.int32),
                           lay.tensors["weight_scale"].reshape(-1).view(torch.int32))
        assert mod.backend_name == "torch-int8"


def _drop_marker_tensors(t, meta):
    for n in [n for n in t if n.endswith(".comfy_quant")]:
        del t[n]


def test_header_only_markers_still_load_quantized(files, tmp_path):
    """Marker tensors missing, header metadata present -> quantized layers (never plain float)."""
    path = rewrite(files["int8"], tmp_path / "hdr.safetensors", _drop_marker_tensors)
    with Checkpoint(path) as ck:
        assert not any(n.endswith(".comfy_quant") for n in ck.tensors)
    blk = load_blocks(path, [0])[0]
    ref = load_blocks(files["int8"], [0])[0]
    for sub in BLOCK_LINEARS:
        lay = blk.linear(sub)
        assert lay.is_quantized and lay.source == "header" and lay.convrot
        assert torch.equal(lay.weight, ref.linear(sub).weight)
    assert runtime_block(blk, device="cpu").qkv_proj.backend_name == "torch-int8"


def test_tensor_markers_without_header_load_quantized(files, tmp_path):
    path = rewrite(files["int8"], tmp_path / "tm.safetensors", lambda t, m: m.pop(HEADER_KEY))
    blk = load_blocks(path, [0])[0]
    assert all(blk.linear(s).source == "tensor" and blk.linear(s).is_quantized
               for s in BLOCK_LINEARS)


def test_metadata_only_keys_are_filtered(files, tmp_path):
    def add(t, meta):
        t["blocks.0.attn.scaled_fp8"] = torch.zeros(1, dtype=torch.uint8)
    path = rewrite(files["int8"], tmp_path / "extra.safetensors", add)
    blk = load_blocks(path, [0])[0]
    assert blk.ignored == ["blocks.0.attn.scaled_fp8"]
    assert all("comfy_quant" not in lay.tensors for lay in blk.layers.values())


def test_name_prefix_is_found(files, tmp_path):
    pre = "model.diffusion_model."

    def prefix(t, meta):
        for n in list(t):
            t[pre + n] = t.pop(n)
        obj = json.loads(meta[HEADER_KEY])
        obj["layers"] = {pre + k: v for k, v in obj["layers"].items()}
        meta[HEADER_KEY] = json.dumps(obj)
    path = rewrite(files["int8"], tmp_path / "pre.safetensors", prefix)
    with Checkpoint(path) as ck:
        assert block_indices(ck) == [0]
    blk = load_blocks(path, [0])[0]
    assert blk.prefix == pre + "blocks.0" and blk.linear("mlp.fc2").is_quantized


# ---------------------------------------------------------------------------- loader: refusals


def _fp8_layer(t, meta):
    w = t.pop(QKV + ".weight")
    t[QKV + ".weight"] = torch.zeros(w.shape, dtype=torch.float8_e4m3fn)
    t[QKV + ".weight_scale"] = torch.ones((), dtype=torch.float32)
    marker = {"format": "float8_e4m3fn"}
    t[QKV + ".comfy_quant"] = marker_tensor(marker)
    set_header_layer(meta, QKV, marker)


def test_a_format_without_an_int8_grid_loads_for_its_decode(files, tmp_path):
    """An fp8 layer is loaded as stored and runs through its codec's decode (no int8 grid)."""
    path = rewrite(files["int8"], tmp_path / "fp8.safetensors", _fp8_layer)
    (block,) = load_blocks(path, [0])
    layer = block.layers["attn.qkv_proj"]
    assert layer.decodes and layer.fields["format"] == "float8_e4m3fn"
    with pytest.raises(VerifyError, match="no int8 grid"):
        layer.int8_grid()


def test_a_nvfp4_marker_on_fp8_tensors_is_refused(files, tmp_path):
    def edit(t, meta):
        _fp8_layer(t, meta)
        t[QKV + ".comfy_quant"] = marker_tensor({"format": "nvfp4"})
        set_header_layer(meta, QKV, {"format": "nvfp4"})
    path = rewrite(files["int8"], tmp_path / "bad.safetensors", edit)
    with pytest.raises(H3QuantError) as ei:
        load_blocks(path, [0])
    assert ei.value.tensor is not None and QKV in ei.value.tensor


def test_quantize_on_load_of_a_prequantized_layer_is_refused(files):
    with pytest.raises(UnsupportedError, match="already quantized"):
        load_blocks(files["int8"], [0], quantize_on_load=True)


def test_quantize_on_load_of_a_float_layer_uses_the_int8_encoding(tmp_path):
    from h3quant.formats.int8.tensors import encode_int8

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 512, generator=g) / 20).to(torch.bfloat16)
    b = torch.randn(32, generator=g).to(torch.bfloat16)
    path = tmp_path / "f.safetensors"
    save_tensors(path, {"lin.weight": w, "lin.bias": b, "norm.weight": torch.ones(512)}, {})
    with Checkpoint(path) as ck:
        scan = scan_checkpoint(ck)
        lay = load_layer(ck, scan.layers["lin"], quantize_on_load=True)
        norm = load_layer(ck, scan.layers["norm"], quantize_on_load=True)
    q, s = encode_int8(w, convrot=True, group_size=256, per_row=True, method="dense")
    assert lay.is_quantized and lay.convrot and lay.source == "load"
    assert torch.equal(lay.weight, q) and torch.equal(lay.tensors["weight_scale"], s)
    assert torch.equal(lay.bias, b)
    assert not norm.is_quantized  # 1-D parameters stay float


@pytest.mark.parametrize("case, exc, code", [
    ("bf16-weight", FormatError, "Q102"),
    ("no-scale", FormatError, "Q101"),
    ("bad-scale-shape", FormatError, "Q103"),
    ("correction", UnsupportedError, "Q107"),
    ("extra-tensor", UnsupportedError, "Q106"),
    ("header-disagrees", MarkerError, "M110"),
    ("int8-without-marker", MarkerError, "M109"),
    ("nul-marker", MarkerError, "M102"),
])
def test_layer_not_matching_its_marker_is_refused(files, tmp_path, case, exc, code):
    def edit(t, meta):
        if case == "bf16-weight":
            t[QKV + ".weight"] = t[QKV + ".weight"].to(torch.bfloat16)
        elif case == "no-scale":
            del t[QKV + ".weight_scale"]
        elif case == "bad-scale-shape":
            t[QKV + ".weight_scale"] = t[QKV + ".weight_scale"][:7]
        elif case == "correction":
            t[QKV + ".weight_correction"] = torch.zeros(3)
        elif case == "extra-tensor":
            t[QKV + ".input_scale"] = torch.ones(())
        elif case == "header-disagrees":
            set_header_layer(meta, QKV, {"format": "int8_tensorwise", "convrot": False})
        elif case == "int8-without-marker":
            del t[QKV + ".comfy_quant"]
            set_header_layer(meta, QKV, None)
        elif case == "nul-marker":
            t[QKV + ".comfy_quant"] = torch.zeros(72, dtype=torch.uint8)
            del meta[HEADER_KEY]
    path = rewrite(files["int8"], tmp_path / f"{case}.safetensors", edit)
    with pytest.raises(exc) as ei:
        load_blocks(path, [0])
    assert ei.value.code == code, str(ei.value)


def test_missing_block_is_a_verify_error(files):
    with pytest.raises(VerifyError, match="no blocks"):
        load_blocks(files["int8"], [5])


# ------------------------------------------------------------------------------------- block


def _inputs(path, rows: int, sigma: float, seed: int):
    """Seeded hidden states, the runtime's conditioning and the independent implementation's
    (time embedding, per-row adaLN row, positions) for a small packed layout."""
    from helpers import independent_h3 as ind

    from h3quant.runtime.model.layout import Timesteps, layout_for_rows
    from h3quant.runtime.model.model import load_time_embedding, make_conditioning, read_float

    lay = layout_for_rows(rows)
    with Checkpoint(path) as ck:
        cond = make_conditioning(lay, Timesteps.from_sigma(sigma), load_time_embedding(ck),
                                 read_float(ck, "rope.inv_freq").clone(), torch.float32, "cpu")
    src, _ = read_tensors(path)
    tv, ta, values = ind.timesteps(sigma)
    temb, silu = ind.time_embedding(src, values)
    iv, ia = values.index(tv), values.index(ta)
    row = torch.tensor([3 * iv + 1] * lay.text + [3 * ia + 2] * (2 * lay.audio_frames)
                       + [3 * iv] * lay.video_rows)
    pos = ind.positions(lay.text, lay.frames, lay.height, lay.width, lay.audio_frames)
    hidden = src["blocks.0.norm1.weight"].shape[0]
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    return x, cond, (src, temb, silu, row, pos)


def test_float_block_matches_an_independent_implementation(files):
    from helpers import independent_h3 as ind

    x, cond, (src, temb, silu, row, pos) = _inputs(files["bf16"], 24, 0.37, seed=3)
    assert len({r for r in row.tolist()}) == 3  # text, audio and video rows use different rows
    rb = reference_block(load_blocks(files["bf16"], [0])[0])
    with torch.no_grad():
        y = rb(x, cond)
        want = ind.dit_block(src, 0, x, temb, silu, row, pos)
    assert y.shape == x.shape
    err = ((y - want).norm() / (want - x).norm()).item()
    assert err < 1e-5, err  # fp32 rounding
    assert (y - x).norm() > 0.1 * x.norm()  # the block does change its input


def test_attention_matches_sdpa_and_rms_norm_is_unit_rms():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 3, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    assert torch.allclose(attention(q, k, v), want.transpose(0, 1).reshape(5, 48), atol=1e-5)
    y = rms_norm(torch.randn(4, 64, generator=g) * 7, torch.ones(64))
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(4), atol=1e-4)


def test_runtime_block_tracks_the_dequantized_reference(files):
    blk = load_blocks(files["int8"], [0])[0]
    rb, qb = reference_block(blk), runtime_block(blk, device="cpu")
    x, cond, _ = _inputs(files["int8"], 16, 0.6, seed=1)
    with torch.no_grad():
        d_ref, d_q = rb(x, cond) - x, qb(x, cond) - x
    rel = ((d_q - d_ref).norm() / d_ref.norm()).item()
    assert 0 < rel < 0.1  # activation quantization only; measured ~0.02


def test_reference_dequantization_matches_the_source_weights(files):
    src, _ = read_tensors(files["bf16"])
    blk = load_blocks(files["int8"], [0])[0]
    for sub in BLOCK_LINEARS:
        w = src[f"blocks.0.{sub}.weight"].float()
        rel = ((blk.linear(sub).dequantize() - w).norm() / w.norm()).item()
        assert 0 < rel < 0.02, sub  # int8 per-row ConvRot; ~0.009 measured
