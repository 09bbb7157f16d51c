"""Scheme registry: tensor sets per format, check_layer findings, layer_report numbers."""

import math
from pathlib import Path

import pytest
import torch

from helpers.forge import W4A8, codes, expect_error, int8_layer, save, validate, w4a8_layer
from h3quant.formats import registry
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.dtypes import itemsize
from h3quant.formats.layers import Layer
from h3quant.formats.markers import SUPPORTED_FORMATS, QuantFormat, effective_fields
from h3quant.formats.check import PLAIN_FLOAT, SCHEMES, check_layer
from h3quant.formats.report import layer_report

INT8 = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}


def _layer(specs: dict, fields: dict | None = None, name: str = "blk.fc") -> Layer:
    """A header-only layer: TensorInfo entries with no data behind them."""
    tensors, pos = {}, 0
    for suffix, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        tensors[suffix] = TensorInfo(f"{name}.{suffix}", dtype, tuple(shape), pos, pos + nbytes,
                                     Path("none.safetensors"))
        pos += nbytes
    return Layer(name, tensors, effective_fields(fields) if fields else None,
                 "tensor" if fields else None)


def _codes(layer):
    return sorted(f.code for f in check_layer(layer))


def _int8(n=8, k=256, scale=("F32", [8, 1]), **extra):
    return {"weight": ("I8", [n, k]), "weight_scale": scale, **extra}


def _w4a8(n=8, k=256, g=16, codebook=True, **extra):
    s = {"weight": ("I8", [n, k // 2]), "weight_s_rel": ("F8_E4M3", [n, k // g]),
         "weight_s_channel": ("F32", [n])}
    if codebook:
        s["weight_codebook"] = ("F32", [16])
    s.update(extra)
    return s


# ----------------------------------------------------------------------------- registry


def test_registry_covers_every_format_and_supported_flags():
    assert set(SCHEMES) == set(QuantFormat)
    assert {f for f in SCHEMES if registry.get(f) is not None} == set(SUPPORTED_FORMATS)
    assert PLAIN_FLOAT.format is None


# ----------------------------------------------------------------------------- int8


@pytest.mark.parametrize("shape", [[8, 1], [], [8], [1]])
def test_int8_legal_scale_shapes(shape):
    plain = {"format": "int8_tensorwise"}
    assert _codes(_layer(_int8(scale=("F32", shape)), plain)) == []
    # ConvRot layers are per-row: a single scale is refused (by verify and convert too)
    expect = ["Q103"] if shape in ([], [1]) else []
    assert _codes(_layer(_int8(scale=("F32", shape)), INT8)) == expect


def test_int8_with_bias_and_input_scale_is_legal():
    spec = _int8(bias=("BF16", [8]), input_scale=("F32", []))
    assert _codes(_layer(spec, INT8)) == []


@pytest.mark.parametrize("spec, code, tensor", [
    (_int8(scale=("F32", [8, 2])), "Q103", "weight_scale"),
    (_int8(scale=("F32", [256, 1])), "Q103", "weight_scale"),
    (_int8(scale=("BF16", [8, 1])), "Q102", "weight_scale"),
    ({"weight": ("I8", [8, 256])}, "Q101", "weight_scale"),
    (_int8(weight=("U8", [8, 256])), "Q102", "weight"),
    (_int8(weight=("I8", [8, 16, 16])), "Q103", "weight"),
    (_int8(bias=("I32", [8])), "Q102", "bias"),
    (_int8(bias=("BF16", [9])), "Q103", "bias"),
    (_int8(weight_s_rel=("F8_E4M3", [8, 16])), "Q106", "weight_s_rel"),
])
def test_int8_tensor_findings(spec, code, tensor):
    found = check_layer(_layer(spec, INT8))
    hits = [f for f in found if f.code == code]
    assert hits, found
    assert hits[0].tensor == f"blk.fc.{tensor}"
    assert "expected" in hits[0].message or code in ("Q106",)


def test_int8_scale_shape_message_names_expectation():
    (f,) = check_layer(_layer(_int8(scale=("F32", [8, 2])), INT8))
    assert "[8, 2]" in f.message and "[8, 1]" in f.message and "N=8" in f.message


@pytest.mark.parametrize("fields, k, expect", [
    ({**INT8, "convrot_groupsize": 48}, 96, ["Q104"]),
    ({**INT8, "convrot_groupsize": 2}, 256, ["Q104"]),
    ({**INT8, "convrot_groupsize": 256}, 320, ["Q104"]),
    ({**INT8, "convrot_groupsize": 64}, 320, []),
    ({"format": "int8_tensorwise"}, 100, []),  # no ConvRot: any K
])
def test_int8_convrot_group(fields, k, expect):
    assert _codes(_layer(_int8(k=k), fields)) == expect


# ----------------------------------------------------------------------------- W4A8


@pytest.mark.parametrize("codebook", [True, False])
def test_w4a8_legal(codebook):
    assert _codes(_layer(_w4a8(codebook=codebook), W4A8)) == []


def test_w4a8_u8_s_rel_is_read_as_e4m3():
    assert _codes(_layer(_w4a8(weight_s_rel=("U8", [8, 16])), W4A8)) == []


def test_w4a8_unpacked_weight_is_wrong_packed_width():
    found = check_layer(_layer(_w4a8(weight=("I8", [8, 256])), W4A8))
    assert [f.code for f in found] == ["Q103"]
    assert found[0].tensor == "blk.fc.weight"
    assert "K=256" in found[0].message and "[8, 128]" in found[0].message


def test_w4a8_six_bit_variant_is_unsupported_not_broken():
    assert _codes(_layer(_w4a8(weight=("I8", [8, 192]), codebook=False), W4A8)) == ["Q105"]


@pytest.mark.parametrize("s_rel, code", [
    (("F8_E4M3", [9, 16]), "Q103"),
    (("F8_E4M3", [128]), "Q103"),
    (("F32", [8, 16]), "Q102"),
])
def test_w4a8_s_rel(s_rel, code):
    found = check_layer(_layer(_w4a8(weight_s_rel=s_rel), W4A8))
    assert code in [f.code for f in found]
    assert any(f.tensor == "blk.fc.weight_s_rel" for f in found)


@pytest.mark.parametrize("extra, code", [
    ({"weight_s_channel": ("F32", [8, 1])}, "Q103"),
    ({"weight_s_channel": ("BF16", [8])}, "Q102"),
    ({"weight_codebook": ("F32", [15])}, "Q103"),
])
def test_w4a8_other_tensors(extra, code):
    assert code in _codes(_layer(_w4a8(**extra), W4A8))


def test_w4a8_missing_s_channel():
    spec = _w4a8()
    del spec["weight_s_channel"]
    assert _codes(_layer(spec, W4A8)) == ["Q101"]


def test_w4a8_correction_is_a_warning_not_unexpected():
    found = check_layer(_layer(_w4a8(weight_correction=("F32", [16, 8])), W4A8))
    assert [f.code for f in found] == ["Q107"]
    assert found[0].severity.value == "warning"


@pytest.mark.parametrize("fields, spec, expect", [
    ({**W4A8, "convrot_groupsize": 256}, _w4a8(k=128), ["Q104"]),
    ({**W4A8, "convrot_groupsize": 32}, _w4a8(k=256), ["Q104"]),
    ({**W4A8, "group_size": 12, "convrot_groupsize": 4}, _w4a8(k=96, g=12), ["Q108"]),
    ({**W4A8, "group_size": 8, "convrot_groupsize": 4}, _w4a8(k=24, g=8), ["Q108"]),
    ({**W4A8, "group_size": 32, "convrot_groupsize": 64}, _w4a8(k=64, g=32), []),
])
def test_w4a8_divisibility(fields, spec, expect):
    assert _codes(_layer(spec, fields)) == expect


# ----------------------------------------------------------------------------- unsupported


@pytest.mark.parametrize("fmt, spec, code", [
    ("float8_e4m3fn", {"weight": ("F8_E4M3", [8, 64])}, "Q101"),
    ("float8_e4m3fn", {"weight": ("F8_E5M2", [8, 64]), "weight_scale": ("F32", [])}, "Q102"),
    ("nvfp4", {"weight": ("U8", [8, 32]), "weight_scale": ("F8_E4M3", [8, 4])}, "Q101"),
    ("nvfp4", {"weight": ("U8", [8, 32]), "weight_scale": ("F8_E4M3", [8, 2]),
               "weight_scale_2": ("F32", [])}, "Q103"),
    ("mxfp8", {"weight": ("F8_E4M3", [8, 64]), "weight_scale": ("F32", [8, 2])}, "Q102"),
])
def test_unsupported_formats_broken_sets(fmt, spec, code):
    assert code in _codes(_layer(spec, {"format": fmt}))


def test_plain_float_layer_has_no_scheme_findings():
    assert check_layer(_layer({"weight": ("BF16", [8, 16]), "bias": ("F32", [8])})) == []


# ----------------------------------------------------------------------------- layer_report


def test_report_int8_per_row():
    n, k = 24, 512
    rep = layer_report(_layer(_int8(n, k, scale=("F32", [n, 1]), bias=("BF16", [n])), INT8))
    assert (rep.format, rep.N, rep.K) == ("int8_tensorwise", n, k)
    assert rep.bits_per_weight == pytest.approx(8 * (n * k + 4 * n) / (n * k), abs=1e-4)
    assert rep.nbytes == n * k + 4 * n + 2 * n  # bias counts in bytes, not in bpw
    assert rep.dtypes == {"bias": "BF16", "weight": "I8", "weight_scale": "F32"}


def test_report_w4a8_takes_k_from_the_scale_grid():
    n, k = 16, 1024
    rep = layer_report(_layer(_w4a8(n, k), W4A8))
    assert (rep.N, rep.K) == (n, k)
    expected = 8 * (n * k // 2 + n * k // 16 + 4 * n + 64) / (n * k)
    assert rep.bits_per_weight == pytest.approx(expected, abs=1e-4)
    assert 4.5 < rep.bits_per_weight < 5.0


def test_report_float_layers():
    rep = layer_report(_layer({"weight": ("BF16", [8, 16])}))
    assert (rep.format, rep.N, rep.K, rep.bits_per_weight) == ("BF16", 8, 16, 16.0)
    norm = layer_report(_layer({"weight": ("F32", [128])}))
    assert (norm.N, norm.K, norm.bits_per_weight, norm.params) == (128, None, 32.0, 128)


# ----------------------------------------------------------------------------- via the CLI


def _save_int8(tmp_path, **kw):
    return save(tmp_path / "s.safetensors", int8_layer("blocks.0.mlp.fc2", **kw))


@pytest.mark.parametrize("kw", [{}, {"scale_shape": (), "marker": {"format": "int8_tensorwise"}},
                                {"scale_shape": (8,)}, {"bias": True}],
                         ids=["per-row", "scalar", "flat", "bias"])
def test_cli_int8_legal(tmp_path, kw):
    res, doc = validate(_save_int8(tmp_path, **kw), "--deep")
    assert res.exit_code == 0, doc["findings"]


@pytest.mark.parametrize("codebook", [True, False])
def test_cli_w4a8_legal(tmp_path, codebook):
    t = w4a8_layer("blocks.0.attn.out_proj", codebook=codebook)
    res, doc = validate(save(tmp_path / "w.safetensors", t), "--deep")
    assert res.exit_code == 0, doc["findings"]


def test_cli_wrong_scale_shape(tmp_path):
    expect_error(_save_int8(tmp_path, scale_shape=(8, 2)), "Q103")


def test_cli_wrong_scale_dtype(tmp_path):
    t = int8_layer("a")
    t["a.weight_scale"] = t["a.weight_scale"].bfloat16()
    expect_error(save(tmp_path / "s.safetensors", t), "Q102")


def test_cli_group_not_power_of_4(tmp_path):
    marker = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 128}
    expect_error(_save_int8(tmp_path, marker=marker), "Q104")


def test_cli_group_not_dividing_k(tmp_path):
    expect_error(_save_int8(tmp_path, k=320), "Q104")


def test_cli_w4a8_wrong_packed_width(tmp_path):
    t = w4a8_layer("a")
    t["a.weight"] = torch.zeros(8, 256, dtype=torch.int8)  # unpacked
    doc = expect_error(save(tmp_path / "w.safetensors", t), "Q103")
    assert any(f["tensor"] == "a.weight" for f in doc["findings"])


def test_cli_w4a8_wrong_s_rel_shape(tmp_path):
    t = w4a8_layer("a")
    t["a.weight_s_rel"] = t["a.weight_s_rel"][:4]
    doc = expect_error(save(tmp_path / "w.safetensors", t), "Q103")
    assert any(f["tensor"] == "a.weight_s_rel" for f in doc["findings"])


def test_cli_weight_correction_warns(tmp_path):
    t = w4a8_layer("a")
    t["a.weight_correction"] = torch.zeros(16, 8)
    res, doc = validate(save(tmp_path / "w.safetensors", t))
    assert res.exit_code == 0 and "Q107" in codes(doc)


def test_cli_fp8_format_is_supported(tmp_path):
    t = {"a.weight": torch.zeros(8, 64, dtype=torch.float8_e4m3fn),
         "a.weight_scale": torch.tensor(1.0)}
    p = save(tmp_path / "f.safetensors", t, header={"a": {"format": "float8_e4m3fn"}})
    res, doc = validate(p)
    assert res.exit_code == 0 and not codes(doc) & {"Q101", "Q102", "Q103", "Q105"}


# ----------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("layout, kw, marker, expect", [
    ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True, "convrot_groupsize": 256},
     INT8, set()),
    ("AsymW4A8Int8Layout", {}, W4A8, set()),
    ("TensorCoreFP8Layout", {}, {"format": "float8_e4m3fn"}, set()),
    ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}, set()),
    ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}, set()),
    ("TensorCoreConvRotW4A4Layout", {}, {"format": "convrot_w4a4"}, set()),
])
def test_comfy_kitchen_layouts_match_the_registry(tmp_path, layout, kw, marker, expect):
    pytest.importorskip("comfy_kitchen")
    from comfy_kitchen.tensor import QuantizedTensor

    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    # FORMATS.md 3: the reference int8 quantizer upcasts to fp32 before rotating (rotating in
    # bf16 yields a few -128 codes, which --deep reports as D103).
    w = w.float() if layout == "TensorWiseINT8Layout" else w
    sd = QuantizedTensor.from_float(w, layout, **kw).state_dict("blk.fc.weight")
    t = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v).contiguous()
         for k, v in sd.items()}
    res, doc = validate(save(tmp_path / "k.safetensors", t, header={"blk.fc": marker}), "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert codes(doc) - {"T104"} == expect
