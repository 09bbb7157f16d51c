"""mxfp8 layers: bit-exact with comfy-kitchen 0.2.40's eager quantizer (codes, e8m0 block scales in
cuBLAS's blocked layout), read, validated, verified and converted both ways."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.fp8 import (block_linears, convert, kitchen_file, kitchen_state, tiny, validate_json,
                      verify_json)
from helpers.forge import cli, codes, save
from h3quant.formats import registry
from h3quant.formats.mxfp8.tensors import decode_mxfp8, encode_mxfp8, scale_shape, swizzle, unswizzle
from h3quant.formats.markers import marker_tensor

pytest.importorskip("comfy_kitchen")

MX = {"format": "mxfp8"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("mx") / "bf16.safetensors")


# ------------------------------------------------------------------------- tensors vs kitchen


@pytest.mark.parametrize("shape, dtype", [((64, 96), torch.bfloat16), ((256, 512), torch.bfloat16),
                                          ((160, 128), torch.float16), ((32, 32), torch.float32)])
def test_encode_and_decode_match_kitchen(shape, dtype):
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout

    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * 0.03).to(dtype)
    w[0, :32] = 0  # an all-zero block: scale code 0, zero codes
    w[1, 32:64] = 1e-30  # a block below e4m3's range
    kq, kp = TensorCoreMXFP8Layout.quantize(w)
    q, s = encode_mxfp8(w)
    assert torch.equal(_bits(q), _bits(kq))
    assert s.dtype == kp.scale.dtype == torch.float8_e8m0fnu and s.shape == kp.scale.shape
    assert tuple(s.shape) == scale_shape(*shape) and torch.equal(_bits(s), _bits(kp.scale))
    for out in (torch.bfloat16, torch.float32):
        kp2 = TensorCoreMXFP8Layout.Params(scale=kp.scale, orig_dtype=out, orig_shape=kp.orig_shape)
        assert torch.equal(decode_mxfp8(q, s, out), TensorCoreMXFP8Layout.dequantize(kq, kp2))


def test_blocked_layout_matches_kitchen_and_inverts():
    from comfy_kitchen.float_utils import from_blocked, to_blocked

    s = torch.randint(0, 255, (200, 9), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    mine = swizzle(s)
    assert torch.equal(mine, to_blocked(s, flatten=False))
    assert torch.equal(unswizzle(mine, 200, 9), s)
    assert torch.equal(unswizzle(mine, 200, 9), from_blocked(mine, 200, 9))


def test_decode_rows_of_a_chunk_reads_their_tiles():
    w = torch.randn(384, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    q, s = encode_mxfp8(w)
    whole = decode_mxfp8(q, s)
    assert torch.equal(decode_mxfp8(q[130:300], s, row0=130), whole[130:300])


@pytest.mark.slow
def test_full_dims_layer_matches_kitchen():
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout

    w = (torch.randn(5376, 5376, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    kq, kp = TensorCoreMXFP8Layout.quantize(w)
    out = registry.get("mxfp8").encoder.encode(w, MX, None)
    assert torch.equal(_bits(out["weight"]), _bits(kq))
    assert torch.equal(_bits(out["weight_scale"]), _bits(kp.scale))


# ------------------------------------------------------------------------- convert --to mxfp8


def test_convert_is_byte_identical_to_kitchen(src, tmp_path):
    out = tmp_path / "o.safetensors"
    convert(src, out, "mxfp8")
    a, b = load_file(src), load_file(out)
    names = block_linears(a)
    assert names
    for name in names:
        k = kitchen_state(a[f"{name}.weight"], "TensorCoreMXFP8Layout", name)
        assert torch.equal(_bits(b[f"{name}.weight"]), _bits(k[f"{name}.weight"])), name
        assert b[f"{name}.weight_scale"].dtype == torch.float8_e8m0fnu
        assert torch.equal(_bits(b[f"{name}.weight_scale"]), _bits(k[f"{name}.weight_scale"])), name
        assert bytes(b[f"{name}.comfy_quant"].tolist()) == bytes(marker_tensor(MX).tolist())
    code, doc = validate_json(out, "--deep")
    assert code == 0 and not codes(doc), doc["findings"]


@pytest.mark.parametrize("u8", [False, True])
def test_kitchen_written_file_inspects_validates_verifies(src, tmp_path, u8):
    """kitchen's state_dict (e8m0 scales), or the scales as raw U8 bytes, as ComfyUI also reads."""
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout

    path = tmp_path / "k.safetensors"
    kitchen_file(src, path, "TensorCoreMXFP8Layout", "mxfp8")
    if u8:
        t = load_file(path)
        t = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v) for k, v in t.items()}
        save(path, t)
    assert cli("inspect", path).exit_code == 0
    code, doc = validate_json(path, "--deep")
    assert code == 0 and not codes(doc), doc["findings"]
    code, doc = verify_json(path, "--reference", src)
    assert code == 0 and doc["passed"], doc["failures"]
    t = load_file(path)
    codec = registry.get("mxfp8")
    for name in block_linears(load_file(src)):
        q, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
        p = TensorCoreMXFP8Layout.Params(scale=s.view(torch.float8_e8m0fnu), orig_dtype=torch.bfloat16,
                                         orig_shape=tuple(q.shape))
        assert torch.equal(codec.decoder.decode_weight({"weight": q, "weight_scale": s}, None, torch.bfloat16),
                           TensorCoreMXFP8Layout.dequantize(q, p))


# ------------------------------------------------------------------------- bad files


def _mx_layer(n=128, k=64, **over) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, s = encode_mxfp8(w)
    t = {"blk.fc.weight": q, "blk.fc.weight_scale": s}
    t.update(over)
    return {k_: v for k_, v in t.items() if v is not None}


@pytest.mark.parametrize("over, code, deep", [
    ({"blk.fc.weight_scale": torch.ones(128, 4)}, "Q102", False),
    ({"blk.fc.weight_scale": torch.full((128, 2), 127, dtype=torch.uint8)}, "Q130", False),
    ({"blk.fc.weight_scale": torch.full((64, 4), 127, dtype=torch.uint8)}, "Q130", False),
    ({"blk.fc.weight": torch.zeros(128, 48, dtype=torch.float8_e4m3fn)}, "Q130", False),
    ({"blk.fc.weight": torch.zeros(120, 64, dtype=torch.float8_e4m3fn)}, "Q130", False),
    ({"blk.fc.weight_scale": None}, "Q101", False),
    ({"blk.fc.weight": torch.zeros(128, 64, dtype=torch.float8_e5m2)}, "Q102", False),
    ({"blk.fc.weight_scale": torch.full((128, 4), 255, dtype=torch.uint8)}, "D131", True),
    ({"blk.fc.weight": torch.full((128, 64), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)},
     "D130", True),
    ({"blk.fc.input_scale": torch.tensor(float("nan"))}, "D101", True),
])
def test_bad_mxfp8_layers_are_findings(tmp_path, over, code, deep):
    t = _mx_layer(**over)
    t = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v) for k, v in t.items()}
    t["blk.fc.comfy_quant"] = marker_tensor(MX)
    p = save(tmp_path / "bad.safetensors", t)
    code_, doc = validate_json(p, *(["--deep"] if deep else []))
    assert code_ == 1 and code in codes(doc), doc["findings"]
    assert cli("inspect", p).exit_code in (0, 1)


def test_convert_refuses_a_bad_mxfp8_source(src, tmp_path):
    q = tmp_path / "q.safetensors"
    convert(src, q, "mxfp8")
    t = load_file(q)
    name = block_linears(t)[0]
    t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"].view(torch.uint8)[:, :2].contiguous()
    save(tmp_path / "bad.safetensors", t)
    r = cli("convert", tmp_path / "bad.safetensors", tmp_path / "o.safetensors", "--to", "bf16")
    assert r.exit_code != 0 and "Q130" in r.output, r.output
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------------- convert from mxfp8


def test_convert_from_mxfp8_to_bf16_int8_fp8_and_back(src, tmp_path):
    q = tmp_path / "q.safetensors"
    convert(src, q, "mxfp8")
    qt = load_file(q)
    names = block_linears(load_file(src))
    bf = tmp_path / "bf.safetensors"
    convert(q, bf, "bf16")
    b = load_file(bf)
    for name in names:
        want = decode_mxfp8(qt[f"{name}.weight"], qt[f"{name}.weight_scale"]).bfloat16()
        assert torch.equal(b[f"{name}.weight"], want), name
    for target in ("int8-convrot", "fp8"):
        out = tmp_path / f"{target}.safetensors"
        convert(q, out, target)
        code, doc = validate_json(out, "--deep")
        assert code == 0, doc["findings"]
    back = tmp_path / "back.safetensors"
    convert(bf, back, "mxfp8")
    r = load_file(back)
    for name in names:
        # kitchen's quantizer of the bf16 decode, and the same values as the first encode (a
        # block whose peak rounded down to half a power of two comes back one exponent lower,
        # codes doubled: other bytes, equal values)
        k = kitchen_state(b[f"{name}.weight"], "TensorCoreMXFP8Layout", name)
        assert torch.equal(_bits(r[f"{name}.weight"]), _bits(k[f"{name}.weight"])), name
        assert torch.equal(decode_mxfp8(r[f"{name}.weight"], r[f"{name}.weight_scale"]),
                           decode_mxfp8(qt[f"{name}.weight"], qt[f"{name}.weight_scale"])), name


def test_mixed_recipe_in_one_pass_matches_kitchen_per_layer(src, tmp_path):
    """mxfp8 MLP + fp8 out_proj + int8 ConvRot qkv in one convert; each layer is what kitchen's
    quantizer of its format makes of the same bf16 weight; the file validates and verifies."""
    out = tmp_path / "mix.safetensors"
    convert(src, out, "int8-convrot", "--layer", r"mlp\.=mxfp8", "--layer", "out_proj=fp8")
    a, b = load_file(src), load_file(out)
    for name in block_linears(a):
        w = a[f"{name}.weight"]
        if ".mlp." in name:
            k = kitchen_state(w, "TensorCoreMXFP8Layout", name)
        elif name.endswith("out_proj"):
            k = kitchen_state(w, "TensorCoreFP8Layout", name)
        else:
            assert b[f"{name}.weight"].dtype == torch.int8
            continue
        for sfx in ("weight", "weight_scale"):
            assert torch.equal(_bits(b[f"{name}.{sfx}"]), _bits(k[f"{name}.{sfx}"])), (name, sfx)
    code, doc = validate_json(out, "--deep")
    assert code == 0 and not codes(doc), doc["findings"]
    code, doc = verify_json(out, "--reference", src)
    assert code == 0 and doc["passed"], doc["failures"]
    assert {c["format"] for c in doc["layers"]} == {"int8_tensorwise", "float8_e4m3fn", "mxfp8"}
