"""int4_tensorwise, a ComfyUI fork's name for the convrot_w4a4 layout: read as convrot_w4a4
(files written by comfy-kitchen's convrot_w4a4 quantizer, renamed here), noted by validate,
never written under that name."""

import json

import pytest
import torch

from helpers.forge import cli, codes, expect_error, validate
from helpers.kitchen_files import block_linear_names, kitchen_file, marker_tensor, read_all
from h3quant.synth import synth_checkpoint

pytest.importorskip("comfy_kitchen")
LAYOUT = "TensorCoreConvRotW4A4Layout"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("alias")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=4)
    canon = kitchen_file(src, d / "canon.safetensors", LAYOUT,
                         {"format": "convrot_w4a4", "convrot_groupsize": 64},
                         convrot_groupsize=64)
    t = read_all(canon)
    for name in block_linear_names(t):
        t[name + ".comfy_quant"] = marker_tensor({"format": "int4_tensorwise", "convrot": True,
                                                  "convrot_groupsize": 64})
    alias = d / "alias.safetensors"
    save_file(t, str(alias))
    return src, canon, alias


def _markers(tensors):
    return {k: json.loads(bytes(v.tolist())) for k, v in tensors.items()
            if k.endswith(".comfy_quant")}


def test_validate_reads_it_as_convrot_w4a4_and_notes_the_alias(files):
    _, _, alias = files
    res, doc = validate(alias, "--deep")
    assert res.exit_code == 0 and doc["counts"]["error"] == 0, doc["findings"]
    notes = [f for f in doc["findings"] if f["code"] == "Q126"]
    assert len(notes) == 8 and all(f["severity"] == "info" for f in notes)
    assert "read as convrot_w4a4" in notes[0]["message"]
    res = cli("inspect", alias, "--layers")
    assert res.exit_code == 0 and "Q126" in res.output and "read as convrot_w4a4 g=64" in res.output


def test_it_decodes_as_kitchens_convrot_w4a4(files, tmp_path):
    from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight

    _, canon, alias = files
    out = tmp_path / "bf16.safetensors"
    assert cli("convert", alias, out, "--to", "bf16", "-q").exit_code == 0
    k, b = read_all(canon), read_all(out)
    for name in block_linear_names(k):
        want = dequantize_convrot_w4a4_weight(k[name + ".weight"], k[name + ".weight_scale"], 64,
                                              output_dtype=torch.float32)
        assert torch.equal(b[name + ".weight"], want.bfloat16()), name


def test_convert_to_int4_convrot_keeps_the_codes_under_the_canonical_name(files, tmp_path):
    _, canon, alias = files
    out = tmp_path / "int4.safetensors"
    res = cli("convert", alias, out, "--to", "int4-convrot", "--group-size", 64, "-q")
    assert res.exit_code == 0, res.output
    k, b = read_all(canon), read_all(out)
    for name in block_linear_names(k):
        for s in (".weight", ".weight_scale"):
            assert torch.equal(b[name + s], k[name + s]), name + s
    assert {m["format"] for m in _markers(b).values()} == {"convrot_w4a4"}


def test_a_layer_left_as_it_is_is_written_as_convrot_w4a4(files, tmp_path):
    _, canon, alias = files
    out = tmp_path / "mixed.safetensors"
    res = cli("convert", alias, out, "--to", "int8", "--exclude", r"mlp\.fc2", "-q")
    assert res.exit_code == 0, res.output
    b, k = read_all(out), read_all(canon)
    kept = [n for n in block_linear_names(b) if n.endswith("mlp.fc2")]
    assert len(kept) == 2
    for name in kept:
        assert _markers(b)[name + ".comfy_quant"]["format"] == "convrot_w4a4"
        assert torch.equal(b[name + ".weight"], k[name + ".weight"])
    assert "int4_tensorwise" not in json.dumps(_markers(b))
    res, doc = validate(out)
    assert res.exit_code == 0 and "Q126" not in codes(doc), doc["findings"]


def test_an_unrotated_layer_is_refused(files, tmp_path):
    from safetensors.torch import save_file

    _, _, alias = files
    t = read_all(alias)
    name = block_linear_names(t)[0]
    t[name + ".comfy_quant"] = marker_tensor({"format": "int4_tensorwise", "per_row": True})
    bad = tmp_path / "bad.safetensors"
    save_file(t, str(bad))
    expect_error(bad, "Q127")
    out = tmp_path / "o.safetensors"
    res = cli("convert", bad, out, "--to", "bf16")
    assert res.exit_code == 2 and "Q127" in res.output and not out.exists(), res.output


def test_no_convert_target_writes_the_alias():
    res = cli("convert", "--help")
    assert res.exit_code == 0 and "int4_tensorwise" not in res.output


def test_backends_list_the_format_once_under_its_own_name():
    from h3quant.runtime.decoded import format_routes
    from h3quant.runtime.probe import StaticProbe

    names = [r.format for r in format_routes("cpu", StaticProbe())]
    assert "convrot_w4a4" in names and "int4_tensorwise" not in names
