"""Marker rules through `h3quant validate`: every broken marker seen in released files."""

import json

import pytest
import torch

from helpers.forge import INT8_CONVROT, codes, expect_error, float_layer, int8_layer, save, validate
from h3quant.formats.markers import HEADER_KEY


def _marker(raw: bytes, dtype=torch.uint8) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.uint8).view(dtype) if raw else \
        torch.zeros(0, dtype=dtype)


@pytest.mark.parametrize("raw, code", [
    (bytes(72), "M102"),
    (b"", "M101"),
    (b"[1, 2]", "M104"),
    (b'"int8_tensorwise"', "M104"),
    (b'{"convrot": true}', "M105"),
    (b'{"format": "int4_magic"}', "M106"),
    (b'{"format": "int8_tensorwise", "convrot": "yes"}', "M114"),
    (b'{"format": "int8_tensorwise", "convrot_groupsize": 256.0}', "M114"),
    (b"\xff\xfe{}", "M103"),
], ids=["all-nul", "zero-length", "array", "string", "no-format", "unknown-format",
        "field-type", "field-float", "not-utf8"])
def test_broken_marker_tensor(tmp_path, raw, code):
    t = {**int8_layer("blocks.0.mlp.fc2", marker=_marker(raw)), **float_layer("norm", 8, 1)}
    doc = expect_error(save(tmp_path / "m.safetensors", t, header=False), code)
    hit = [f for f in doc["findings"] if f["code"] == code][0]
    assert hit["tensor"] == "blocks.0.mlp.fc2.comfy_quant"


def test_marker_not_u8(tmp_path):
    raw = json.dumps(INT8_CONVROT).encode()
    t = int8_layer("a", marker=_marker(raw, torch.int8))
    doc = expect_error(save(tmp_path / "m.safetensors", t, header=False), "M107")
    assert "I8" in [f for f in doc["findings"] if f["code"] == "M107"][0]["message"]


def test_marker_without_weight(tmp_path):
    t = int8_layer("a")
    del t["a.weight"], t["a.weight_scale"]
    doc = expect_error(save(tmp_path / "m.safetensors", t, header=False), "M108")
    assert "Q101" not in codes(doc)  # reported once, as the marker rule


def test_quantized_weight_without_marker(tmp_path):
    t = int8_layer("a", with_marker=False)
    doc = expect_error(save(tmp_path / "m.safetensors", t, header=False), "M109")
    assert [f["tensor"] for f in doc["findings"] if f["code"] == "M109"] == ["a.weight"]


def test_header_and_tensor_markers_disagree(tmp_path):
    t = int8_layer("a")
    header = {"a": {**INT8_CONVROT, "convrot_groupsize": 64}}
    doc = expect_error(save(tmp_path / "m.safetensors", t, header=header), "M110")
    msg = [f for f in doc["findings"] if f["code"] == "M110"][0]["message"]
    assert "64" in msg and "256" in msg


def test_header_metadata_not_json(tmp_path):
    t = int8_layer("a")
    p = save(tmp_path / "m.safetensors", t, header=False, metadata={HEADER_KEY: "{oops"})
    expect_error(p, "M111")


def test_header_metadata_without_layers(tmp_path):
    p = save(tmp_path / "m.safetensors", int8_layer("a"), header=False,
             metadata={HEADER_KEY: json.dumps({"format_version": "1.0"})})
    expect_error(p, "M111")


def test_header_only_layer_missing_from_file(tmp_path):
    header = {"a": INT8_CONVROT, "ghost": INT8_CONVROT}
    doc = expect_error(save(tmp_path / "m.safetensors", int8_layer("a"), header=header), "M112")
    assert [f["tensor"] for f in doc["findings"] if f["code"] == "M112"] == ["ghost"]


def test_header_entry_with_unknown_format(tmp_path):
    header = {"a": {"format": "bogus"}}
    expect_error(save(tmp_path / "m.safetensors", int8_layer("a", with_marker=False),
                      header=header), "M106")


# ----------------------------------------------------------------------------- legal markers


def test_marker_with_extra_fields_and_params_nesting(tmp_path):
    marker = {"format": "int8_tensorwise", "orig_dtype": "torch.bfloat16", "per_row": True,
              "params": {"convrot": True, "convrot_groupsize": 256}}
    t = {**int8_layer("a", marker=marker), **int8_layer("b", marker=marker, seed=1)}
    res, doc = validate(save(tmp_path / "m.safetensors", t))
    assert res.exit_code == 0, doc["findings"]
    assert doc["counts"]["error"] == 0 and doc["checked"]["quantized_layers"] == 2


def test_params_nesting_is_honoured(tmp_path):
    # The group size sits only under params; an illegal one must be seen (Q104).
    marker = {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 48}}
    expect_error(save(tmp_path / "m.safetensors", int8_layer("a", marker=marker)), "Q104")


def test_tensor_markers_only_warn_about_missing_header(tmp_path):
    res, doc = validate(save(tmp_path / "m.safetensors", int8_layer("a"), header=False))
    assert res.exit_code == 0
    assert "M113" in codes(doc) and doc["counts"]["error"] == 0


def test_header_markers_only_pass(tmp_path):
    t = int8_layer("a", with_marker=False)
    res, doc = validate(save(tmp_path / "m.safetensors", t, header={"a": INT8_CONVROT}))
    assert res.exit_code == 0, doc["findings"]
    assert doc["checked"]["quantized_layers"] == 1
