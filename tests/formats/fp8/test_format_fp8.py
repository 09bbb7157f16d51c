"""fp8 layers (float8_e4m3fn, float8_e5m2): bit-exact with comfy-kitchen 0.2.40's eager quantizer,
read, validated, verified and converted both ways; ComfyUI's legacy scaled_fp8 marker."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.fp8 import (block_linears, convert, kitchen_file, kitchen_state, tiny, validate_json,
                      verify_json)
from helpers.forge import cli, codes, save
from h3quant.formats import registry
from h3quant.formats.fp8.tensors import decode_fp8, encode_fp8
from h3quant.formats.markers import marker_tensor

pytest.importorskip("comfy_kitchen")

DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
TARGETS = {"fp8": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("fp8") / "bf16.safetensors")


# ------------------------------------------------------------------------- tensors vs kitchen


@pytest.mark.parametrize("fmt", sorted(DTYPES))
@pytest.mark.parametrize("shape, dtype", [((64, 96), torch.bfloat16), ((3, 7), torch.bfloat16),
                                          ((130, 256), torch.float16), ((33, 64), torch.float32)])
def test_encode_and_decode_match_kitchen(fmt, shape, dtype):
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout

    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * 0.03).to(dtype)
    w[0, 0] = 0.4  # an outlier: most codes far below the maximum
    kq, kp = TensorCoreFP8Layout.quantize(w, dtype=DTYPES[fmt])
    q, s = encode_fp8(w, DTYPES[fmt])
    assert torch.equal(_bits(q), _bits(kq))
    assert s.dtype == torch.float32 and s.shape == kp.scale.shape and torch.equal(s, kp.scale)
    for out in (torch.bfloat16, torch.float32):
        kp2 = TensorCoreFP8Layout.Params(scale=kp.scale, orig_dtype=out, orig_shape=kp.orig_shape)
        assert torch.equal(decode_fp8(q, s, out), TensorCoreFP8Layout.dequantize(kq, kp2))


@pytest.mark.parametrize("fmt", sorted(DTYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_in_dtype_encode_is_kitchens_from_such_weights(fmt, dtype):
    """The codec's encode in the weight's own dtype (the fresh encode's second one, behind
    relative verdicts) is kitchen's quantizer on the weight as stored; from float32 the codes
    differ (the reciprocal and the product are rounded to bf16 / f16 there)."""
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout

    from h3quant.formats import registry

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 256, generator=g) * 0.02).to(dtype)
    codec = registry.codec_for({"format": fmt}, tensor="x.weight")
    got = codec.encoder.encode_in_dtype(w, {"format": fmt})
    kq, kp = TensorCoreFP8Layout.quantize(w, dtype=DTYPES[fmt])
    assert torch.equal(_bits(got["weight"]), _bits(kq))
    assert torch.equal(got["weight_scale"], kp.scale)
    from32 = codec.encoder.encode(w.float(), {"format": fmt}, "exact")
    assert not torch.equal(_bits(from32["weight"]), _bits(kq))


def test_encode_in_chunks_on_a_pool_is_the_same_bytes():
    from concurrent.futures import ThreadPoolExecutor

    import h3quant.formats.fp8.tensors as T

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = encode_fp8(w, torch.float8_e4m3fn)
    old = T.CHUNK_ELEMS
    T.CHUNK_ELEMS = 1000  # many chunks
    try:
        with ThreadPoolExecutor(2) as pool:
            chunked = encode_fp8(w, torch.float8_e4m3fn, pool=pool)
    finally:
        T.CHUNK_ELEMS = old
    assert torch.equal(_bits(whole[0]), _bits(chunked[0])) and torch.equal(whole[1], chunked[1])


@pytest.mark.slow
def test_full_dims_layer_matches_kitchen():
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout

    w = (torch.randn(5376, 5376, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    kq, kp = TensorCoreFP8Layout.quantize(w)
    q, s = registry.get("float8_e4m3fn").encoder.encode(w, {"format": "float8_e4m3fn"}, None).values()
    assert torch.equal(_bits(q), _bits(kq)) and torch.equal(s, kp.scale)


# ------------------------------------------------------------------------- convert --to fp8


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_convert_is_byte_identical_to_kitchen(src, tmp_path, target):
    fmt = TARGETS[target]
    out = tmp_path / "o.safetensors"
    convert(src, out, target)
    a, b = load_file(src), load_file(out)
    names = block_linears(a)
    assert names
    for name in names:
        k = kitchen_state(a[f"{name}.weight"], "TensorCoreFP8Layout", name, dtype=DTYPES[fmt])
        assert b[f"{name}.weight"].dtype == DTYPES[fmt]
        assert torch.equal(_bits(b[f"{name}.weight"]), _bits(k[f"{name}.weight"])), name
        assert b[f"{name}.weight_scale"].shape == () and \
            torch.equal(b[f"{name}.weight_scale"], k[f"{name}.weight_scale"]), name
        assert bytes(b[f"{name}.comfy_quant"].tolist()) == bytes(marker_tensor({"format": fmt}).tolist())
    code, doc = validate_json(out, "--deep")
    assert code == 0 and not codes(doc) - {"T104"}, doc["findings"]


@pytest.mark.parametrize("fmt", sorted(DTYPES))
def test_kitchen_written_file_inspects_validates_verifies(src, tmp_path, fmt):
    path = tmp_path / "k.safetensors"
    kitchen_file(src, path, "TensorCoreFP8Layout", fmt, dtype=DTYPES[fmt])
    assert cli("inspect", path).exit_code == 0
    code, doc = validate_json(path, "--deep")
    assert code == 0 and not codes(doc), doc["findings"]
    code, doc = verify_json(path, "--reference", src)
    assert code == 0 and doc["passed"], doc["failures"]
    assert {c["backend"] for c in doc["layers"]} == {"dequant"}
    # the codec's decode is kitchen's dequantize
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout
    t = load_file(path)
    codec = registry.get(fmt)
    for name in block_linears(load_file(src)):
        q, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
        p = TensorCoreFP8Layout.Params(scale=s, orig_dtype=torch.bfloat16, orig_shape=tuple(q.shape))
        assert torch.equal(codec.decoder.decode_weight({"weight": q, "weight_scale": s}, None, torch.bfloat16),
                           TensorCoreFP8Layout.dequantize(q, p))


# ------------------------------------------------------------------------- bad files


def _fp8_layer(**over) -> dict:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 64, generator=g) * 448).clamp(-448, 448).to(torch.float8_e4m3fn)
    t = {"blk.fc.weight": w, "blk.fc.weight_scale": torch.tensor(0.01)}
    t.update(over)
    return {k: v for k, v in t.items() if v is not None}


@pytest.mark.parametrize("over, code, deep", [
    ({"blk.fc.weight_scale": torch.tensor(0.01, dtype=torch.bfloat16)}, "Q102", False),
    ({"blk.fc.weight_scale": torch.tensor([0.01, 0.02])}, "Q103", False),
    ({"blk.fc.weight_scale": None}, "Q101", False),
    ({"blk.fc.input_scale": torch.ones(2, 2)}, "Q103", False),
    ({"blk.fc.weight": torch.zeros(32, 64, dtype=torch.float8_e5m2)}, "Q102", False),
    ({"blk.fc.weight_scale": torch.tensor(float("nan"))}, "D101", True),
    ({"blk.fc.weight_scale": torch.tensor(float("inf"))}, "D101", True),
    ({"blk.fc.weight_scale": torch.tensor(0.0)}, "D102", True),
    ({"blk.fc.weight_scale": torch.tensor(-1.0)}, "D102", True),
    ({"blk.fc.weight": torch.full((32, 64), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)},
     "D130", True),
])
def test_bad_fp8_layers_are_findings(tmp_path, over, code, deep):
    t = _fp8_layer(**over)
    t["blk.fc.comfy_quant"] = marker_tensor({"format": "float8_e4m3fn"})
    p = save(tmp_path / "bad.safetensors", t)
    code_, doc = validate_json(p, *(["--deep"] if deep else []))
    assert code_ == 1 and code in codes(doc), doc["findings"]
    assert cli("inspect", p).exit_code in (0, 1)


def test_nan_codes_in_e5m2_are_a_finding(tmp_path):
    w = torch.full((32, 64), 0x7E, dtype=torch.uint8).view(torch.float8_e5m2)  # exponent 31: NaN
    t = {"blk.fc.weight": w, "blk.fc.weight_scale": torch.tensor(1.0),
         "blk.fc.comfy_quant": marker_tensor({"format": "float8_e5m2"})}
    code, doc = validate_json(save(tmp_path / "n.safetensors", t), "--deep")
    assert code == 1 and "D130" in codes(doc)


# ------------------------------------------------------------------------- convert from fp8


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_convert_from_fp8_to_bf16_and_int8_and_back(src, tmp_path, target):
    fmt = TARGETS[target]
    q = tmp_path / "q.safetensors"
    convert(src, q, target)
    qt = load_file(q)
    names = block_linears(load_file(src))
    # to bf16: the fp32 decode (code x scale) rounded once
    bf = tmp_path / "bf.safetensors"
    convert(q, bf, "bf16")
    b = load_file(bf)
    for name in names:
        want = (qt[f"{name}.weight"].float() * qt[f"{name}.weight_scale"]).bfloat16()
        assert torch.equal(b[f"{name}.weight"], want), name
        assert f"{name}.comfy_quant" not in b and f"{name}.weight_scale" not in b
    with safe_open(bf, "pt") as f:
        assert "_quantization_metadata" not in (f.metadata() or {})
    # to int8 ConvRot: validates and decodes close to the fp8 decode
    i8 = tmp_path / "i8.safetensors"
    convert(q, i8, "int8-convrot")
    code, doc = validate_json(i8, "--deep")
    assert code == 0, doc["findings"]
    # and back to fp8 from the bf16 decode: kitchen's quantizer of that bf16 weight
    back = tmp_path / "back.safetensors"
    convert(bf, back, target)
    r = load_file(back)
    for name in names:
        k = kitchen_state(b[f"{name}.weight"], "TensorCoreFP8Layout", name, dtype=DTYPES[fmt])
        assert torch.equal(_bits(r[f"{name}.weight"]), _bits(k[f"{name}.weight"])), name


# ------------------------------------------------------------------------- scaled_fp8 marker


def test_synth_fp8_carries_comfyui_scaled_fp8_marker(tmp_path):
    p = tmp_path / "s.safetensors"
    assert cli("synth", p, "--blocks", "1", "--dtype", "fp8").exit_code == 0
    with safe_open(p, "pt") as f:
        keys = set(f.keys())
        marker = f.get_tensor("scaled_fp8")
    assert marker.dtype == torch.float8_e4m3fn and marker.numel() == 0  # as ComfyUI writes it
    assert any(k.endswith(".scale_weight") for k in keys)
    code, doc = validate_json(p, "--deep")
    assert code == 0 and not codes(doc), doc["findings"]


def test_scaled_fp8_marker_missing_or_stale_is_a_finding(tmp_path):
    p = tmp_path / "s.safetensors"
    assert cli("synth", p, "--blocks", "1", "--dtype", "fp8").exit_code == 0
    t = load_file(p)
    del t["scaled_fp8"]
    save_file(t, tmp_path / "nomarker.safetensors")
    _, doc = validate_json(tmp_path / "nomarker.safetensors")
    assert "Q131" in codes(doc)
    plain = load_file(tiny(tmp_path / "bf16.safetensors"))
    plain["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(plain, tmp_path / "stale.safetensors")
    _, doc = validate_json(tmp_path / "stale.safetensors")
    assert "Q131" in codes(doc)


@pytest.mark.parametrize("target", ["bf16", "int8-convrot", "fp8"])
def test_convert_writes_no_scaled_fp8_marker(tmp_path, target):
    p = tmp_path / "s.safetensors"
    assert cli("synth", p, "--blocks", "1", "--dtype", "fp8").exit_code == 0
    out = tmp_path / "o.safetensors"
    convert(p, out, target)
    with safe_open(out, "pt") as f:
        assert not any(k == "scaled_fp8" or k.endswith(".scale_weight") for k in f.keys())
    code, doc = validate_json(out)
    assert code == 0 and "Q131" not in codes(doc), doc["findings"]


def test_verify_runs_legacy_scaled_fp8_as_comfyui_loads_it(tmp_path):
    """With the marker, scale_weight layers run as float8_e4m3fn (ComfyUI's convert_old_quants);
    without it ComfyUI would load raw codes, and verify runs nothing."""
    src = tiny(tmp_path / "bf16.safetensors")
    p = tmp_path / "s.safetensors"
    assert cli("synth", p, "--blocks", "1", "--dtype", "fp8").exit_code == 0
    code, doc = verify_json(p, "--reference", src)
    assert code == 0 and doc["passed"], doc["failures"]
    assert {c["format"] for c in doc["layers"]} == {"float8_e4m3fn"}
    t = load_file(p)
    del t["scaled_fp8"]
    save_file(t, tmp_path / "nomarker.safetensors")
    r = cli("verify", tmp_path / "nomarker.safetensors", "--blocks", "1")
    assert r.exit_code != 0  # no layer ComfyUI would scale: nothing runs as fp8
