"""Layer grouping and marker resolution (header metadata vs per-layer marker tensors)."""

import json

import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor
from h3quant.formats.container.writer import save_tensors

INT8 = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}


def _int8_layer(name, n=4, k=256, marker=INT8):
    t = {f"{name}.weight": torch.zeros(n, k, dtype=torch.int8), f"{name}.weight_scale": torch.ones(n, 1)}
    if marker is not None:
        t[f"{name}.comfy_quant"] = marker if isinstance(marker, torch.Tensor) else marker_tensor(marker)
    return t


def _scan(tmp_path, tensors, header_layers=None, raw_meta=None):
    meta = {}
    if header_layers is not None:
        meta[HEADER_KEY] = header_metadata_value(header_layers)
    if raw_meta is not None:
        meta[HEADER_KEY] = raw_meta
    path = tmp_path / "x.safetensors"
    save_tensors(path, tensors, meta or None)
    with Checkpoint(path) as ck:
        return scan_checkpoint(ck)


def _codes(scan):
    return sorted(f.code for f in scan.findings)


def test_clean_file_with_both_forms(tmp_path):
    t = {**_int8_layer("a"), "norm.weight": torch.ones(4).bfloat16(), "rope.inv_freq": torch.ones(16)}
    scan = _scan(tmp_path, t, {"a": INT8})
    assert _codes(scan) == []
    assert scan.layers["a"].source == "header+tensor"
    assert scan.layers["a"].fields["convrot_groupsize"] == 256
    assert set(scan.quantized) == {"a"}
    assert scan.others == ["rope.inv_freq"]
    assert scan.layers["norm"].format is None


def test_header_only_marks_layer_quantized(tmp_path):
    scan = _scan(tmp_path, _int8_layer("a", marker=None), {"a": INT8})
    assert _codes(scan) == []
    assert scan.layers["a"].source == "header"


def test_tensor_only_warns_missing_header(tmp_path):
    scan = _scan(tmp_path, _int8_layer("a"))
    assert _codes(scan) == ["M113"]
    assert scan.layers["a"].source == "tensor"


def test_disagreement_reported_and_header_wins(tmp_path):
    scan = _scan(tmp_path, _int8_layer("a"), {"a": {**INT8, "convrot_groupsize": 64}})
    assert _codes(scan) == ["M110"]
    assert scan.layers["a"].fields["convrot_groupsize"] == 64


def test_extra_fields_and_params_nesting_agree(tmp_path):
    marker = {"format": "int8_tensorwise", "orig_dtype": "torch.bfloat16", "per_row": True,
              "params": {"convrot": True, "convrot_groupsize": 256}}
    scan = _scan(tmp_path, _int8_layer("a", marker=marker), {"a": INT8})
    assert _codes(scan) == []


def test_top_level_field_wins_over_params(tmp_path):
    marker = {"format": "int8_tensorwise", "convrot": True, "params": {"convrot": False}}
    scan = _scan(tmp_path, _int8_layer("a", marker=marker))
    assert scan.layers["a"].fields["convrot"] is True


def test_broken_markers(tmp_path):
    t = {
        **_int8_layer("nul", marker=torch.zeros(72, dtype=torch.uint8)),
        **_int8_layer("empty", marker=torch.zeros(0, dtype=torch.uint8)),
        **_int8_layer("arr", marker=torch.tensor(list(b"[1, 2]"), dtype=torch.uint8)),
        **_int8_layer("nofmt", marker={"convrot": True}),
        **_int8_layer("unk", marker={"format": "int3_magic"}),
        **_int8_layer("badtype", marker={"format": "int8_tensorwise", "convrot": "yes"}),
        "orphan.comfy_quant": marker_tensor(INT8),
        "bare.weight": torch.zeros(2, 2, dtype=torch.int8),
    }
    scan = _scan(tmp_path, t)
    by_tensor = {f.tensor: f.code for f in scan.findings}
    assert by_tensor["nul.comfy_quant"] == "M102"
    assert by_tensor["empty.comfy_quant"] == "M101"
    assert by_tensor["arr.comfy_quant"] == "M104"
    assert by_tensor["nofmt.comfy_quant"] == "M105"
    assert by_tensor["unk.comfy_quant"] == "M106"
    assert by_tensor["badtype.comfy_quant"] == "M114"
    assert by_tensor["orphan.comfy_quant"] == "M108"
    assert by_tensor["bare.weight"] == "M109"
    # broken layers are never treated as quantized
    assert "nul" not in scan.quantized and "unk" not in scan.quantized


def test_header_metadata_problems(tmp_path):
    scan = _scan(tmp_path, _int8_layer("a", marker=None), raw_meta="{not json")
    assert "M111" in _codes(scan)
    scan = _scan(tmp_path, _int8_layer("a"), {"a": INT8, "ghost": INT8})
    assert _codes(scan) == ["M112"]
    scan = _scan(tmp_path, _int8_layer("a"), raw_meta=json.dumps({"format_version": "1.0"}))
    assert "M111" in _codes(scan)
