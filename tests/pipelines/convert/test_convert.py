"""``convert`` core: int8 codes equal the encoder, untouched bytes, metadata, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3quant.formats.markers import MARKER_SUFFIX, parse_header_metadata
from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
from helpers.h3files import block_linears, read_all, sha, small_h3, write

@pytest.fixture
def h3_file(tmp_path) -> Path:
    return write(tmp_path / "in.safetensors", small_h3(), {"origin": "test"})


# ----------------------------------------------------------------------------- tests
def test_int8_convrot_codes_equal_encoder_bit_for_bit(h3_file, tmp_path):
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.formats.int8.codec import int8_marker

    out = tmp_path / "out.safetensors"
    report = convert(h3_file, out, ConvertOptions(target="int8-convrot"))
    src, _, src_raw = read_all(h3_file)
    got, meta, raw = read_all(out)
    converted = sorted(lay["name"] for lay in report.layers if lay["action"] == "convert")
    assert converted == sorted(block_linears())
    marker = int8_marker(convrot=True, group_size=256)
    assert marker == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    for name in converted:
        q, s = encode_int8(src[name + ".weight"], convrot=True, group_size=256, per_row=True)
        assert got[name + ".weight"].dtype == torch.int8
        assert torch.equal(got[name + ".weight"], q)
        assert got[name + ".weight_scale"].dtype == torch.float32
        assert got[name + ".weight_scale"].shape == (q.shape[0], 1)
        assert torch.equal(got[name + ".weight_scale"].view(torch.int32),
                           s.reshape(-1, 1).view(torch.int32))
        assert raw[name + MARKER_SUFFIX] == json.dumps(marker).encode()
    # every other tensor is byte-identical; no tensor lost
    for name, data in src_raw.items():
        layer = name.rsplit(".", 1)[0]
        if layer not in converted:
            assert raw[name] == data, name
    assert set(got) == set(src) | {f"{n}.{s}" for n in converted
                                   for s in ("weight_scale", "comfy_quant")}
    # header metadata == markers; provenance; input metadata kept
    layers = parse_header_metadata(meta)
    assert layers == {n: json.loads(raw[n + MARKER_SUFFIX]) for n in converted}
    assert meta["origin"] == "test"
    assert meta["h3quant.source"] == "in.safetensors"
    assert json.loads(meta["h3quant.options"])["target"] == "int8-convrot"
    assert "h3quant.version" in meta


def test_output_is_deterministic_and_independent_of_workers_and_mmap(h3_file, tmp_path):
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    ra = convert(h3_file, a, ConvertOptions(workers=1))
    convert(h3_file, b, ConvertOptions(workers=3, report=False))
    rc = convert(h3_file, c, ConvertOptions(mmap=False, workers=2))
    assert sha(a) == sha(b) == sha(c)
    for x, y in zip(ra.layers, rc.layers, strict=True):  # threads: last-ulp sums only
        assert x["metrics"] == pytest.approx(y["metrics"], rel=1e-12)


def test_codes_equal_encoder_across_row_chunks(tmp_path, monkeypatch):
    """Several row chunks per layer (small chunk size) still give one-call encoder codes."""
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.pipelines.convert import compute as convert_compute

    monkeypatch.setattr(convert_compute, "CHUNK_ELEMS", 256 * 7)  # 7 rows of K=256 per chunk
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out = tmp_path / "out.safetensors"
    convert(src, out, ConvertOptions(workers=2))
    got, _, _ = read_all(out)
    w = small_h3(blocks=1)["blocks.0.mlp.fc1.weight"]
    q, s = encode_int8(w, convrot=True, group_size=256, per_row=True)
    assert torch.equal(got["blocks.0.mlp.fc1.weight"], q)
    assert torch.equal(got["blocks.0.mlp.fc1.weight_scale"], s.reshape(-1, 1))


def test_plain_int8_target_and_group_size(h3_file, tmp_path):
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.formats.int8.codec import int8_marker

    out = tmp_path / "o.safetensors"
    convert(h3_file, out, ConvertOptions(target="int8"))
    got, meta, raw = read_all(out)
    w = small_h3()["blocks.1.attn.out_proj.weight"]
    q, s = encode_int8(w, convrot=False, per_row=True)
    assert torch.equal(got["blocks.1.attn.out_proj.weight"], q)
    assert json.loads(raw["blocks.1.attn.out_proj.comfy_quant"]) == int8_marker(convrot=False)
    out64 = tmp_path / "o64.safetensors"
    convert(h3_file, out64, ConvertOptions(group_size=64))
    got64, meta64, _ = read_all(out64)
    q, s = encode_int8(w, convrot=True, group_size=64, per_row=True)
    assert torch.equal(got64["blocks.1.attn.out_proj.weight"], q)
    assert parse_header_metadata(meta64)["blocks.1.attn.out_proj"]["convrot_groupsize"] == 64


def test_selection_presets_include_exclude_and_skips(tmp_path):
    t = small_h3(blocks=1)
    t["blocks.0.mlp.fc2.weight"] = t["blocks.0.mlp.fc2.weight"][:, :320].contiguous()  # K=320
    src = write(tmp_path / "in.safetensors", t)
    plan = plan_convert(src, tmp_path / "o.safetensors", ConvertOptions())
    acts = {lay.name: lay for lay in plan.layers}
    assert plan.preset == "h3" and plan.h3
    assert acts["blocks.0.mlp.fc2"].action == "skip"
    assert "K=320" in acts["blocks.0.mlp.fc2"].reason
    assert {n for n, lay in acts.items() if lay.action == "convert"} == {
        "blocks.0.attn.qkv_proj", "blocks.0.attn.out_proj", "blocks.0.mlp.fc1"}
    # the skip shows up in the report too, and the layer is copied unchanged
    out = tmp_path / "o.safetensors"
    report = convert(src, out, ConvertOptions())
    skipped = [lay for lay in report.layers if lay["action"] == "skip"]
    assert [lay["name"] for lay in skipped] == ["blocks.0.mlp.fc2"]
    assert "K=320" in skipped[0]["reason"]
    got, _, _ = read_all(out)
    assert torch.equal(got["blocks.0.mlp.fc2.weight"], t["blocks.0.mlp.fc2.weight"])
    # group size 64 divides 320
    plan64 = plan_convert(src, out.with_suffix(".x"), ConvertOptions(group_size=64))
    assert {lay.name: lay.action for lay in plan64.layers}["blocks.0.mlp.fc2"] == "convert"
    # all-linears takes the refiner, condition_proj, adaLN and heads too
    plan_all = plan_convert(src, out.with_suffix(".y"), ConvertOptions(preset="all-linears",
                                                                       group_size=4))
    names = {lay.name for lay in plan_all.layers if lay.action == "convert"}
    assert {"token_refiner.blocks.0.attn.qkv_proj", "condition_proj",
            "blocks.0.adaln_proj.linear", "final_layer.video_out"} <= names
    assert "blocks.0.norm1" not in names
    # include narrows, exclude removes
    plan_inc = plan_convert(src, out.with_suffix(".z"), ConvertOptions(
        include=(r"\.attn\.",), exclude=("out_proj",)))
    assert [lay.name for lay in plan_inc.layers if lay.action == "convert"] == [
        "blocks.0.attn.qkv_proj"]


def test_non_h3_input_defaults_to_all_linears(tmp_path):
    g = torch.Generator().manual_seed(1)
    t = {"enc.proj.weight": torch.randn(64, 256, generator=g).half(),
         "enc.proj.bias": torch.randn(64, generator=g).half(),
         "enc.norm.weight": torch.randn(256, generator=g).half(),
         "head.weight": torch.randn(10, 200, generator=g)}
    src = write(tmp_path / "m.safetensors", t)
    out = tmp_path / "o.safetensors"
    report = convert(src, out, ConvertOptions())
    assert report.preset == "all-linears" and not report.h3
    acts = {lay["name"]: lay["action"] for lay in report.layers}
    assert acts == {"enc.proj": "convert", "head": "skip"}
    got, _, raw = read_all(out)
    assert got["enc.proj.weight"].dtype == torch.int8
    assert got["enc.proj.bias"].dtype == torch.float16  # bias stays float, unchanged
    assert torch.equal(got["enc.proj.bias"], t["enc.proj.bias"])


def test_report_metrics_match_an_independent_computation(h3_file, tmp_path):
    from h3quant.convrot import rotate
    from h3quant.formats.int8.tensors import decode_int8
    from h3quant.pipelines.convert.compute import sample_rows
    from h3quant.pipelines.convert.report import activation

    out = tmp_path / "o.safetensors"
    report = convert(h3_file, out, ConvertOptions())
    lay = next(x for x in report.layers if x["name"] == "blocks.0.mlp.fc1")
    m = lay["metrics"]
    got, _, _ = read_all(out)
    w = small_h3()["blocks.0.mlp.fc1.weight"].float()
    idx = sample_rows(w.shape[0])
    assert m["rows_sampled"] == idx.numel() == 256
    q, s = got["blocks.0.mlp.fc1.weight"][idx], got["blocks.0.mlp.fc1.weight_scale"][idx]
    w_hat = decode_int8(q, s, convrot=True, group_size=256)
    ref = w[idx]
    rel = ((ref - w_hat).norm() / ref.norm()).item()
    assert m["weight_rel_l2"] == pytest.approx(rel, rel=1e-4)
    assert 0 < rel < 0.02
    assert m["sqnr_db"] == pytest.approx(-20 * torch.log10(torch.tensor(rel)).item(), rel=1e-4)
    assert 0.999 < m["cosine"] <= 1.0
    # output error of the int8 math, recomputed in plain fp64
    x = activation(256)
    xr = rotate(x, 256).double()
    s_x = (xr.abs().amax(1, keepdim=True) / 127).clamp(min=1e-30)
    q_x = torch.round(xr / s_x).clamp(-128, 127)
    y = (q_x @ q.double().t()) * s_x * s.double().reshape(1, -1)
    y_ref = x.double() @ ref.double().t()
    out_rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert m["output_rel_l2"] == pytest.approx(out_rel, rel=1e-3)
    assert report.summary["layers"] == 8
    assert report.summary["max_output_rel_l2"] >= m["output_rel_l2"]


def test_no_report_skips_metrics(h3_file, tmp_path):
    report = convert(h3_file, tmp_path / "o.safetensors", ConvertOptions(report=False))
    assert all("metrics" not in lay for lay in report.layers)


def test_output_file_mode_follows_umask(h3_file, tmp_path):
    from h3quant.formats.container.writer import default_mode

    out = tmp_path / "o.safetensors"
    convert(h3_file, out, ConvertOptions(report=False))
    assert out.stat().st_mode & 0o777 == default_mode()
