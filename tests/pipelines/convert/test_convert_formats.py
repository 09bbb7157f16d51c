"""``convert`` across formats: sharded I/O, bf16 round trip, re-emit, repairs, W4A8, oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3quant.errors import FormatError, OutputError
from h3quant.formats.container.atomic import MANIFEST_NAME
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.markers import (
    HEADER_KEY,
    MARKER_SUFFIX,
    header_metadata_value,
    marker_tensor,
    parse_header_metadata,
)
from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
from helpers.h3files import block_linears, make_sharded, read_all, resave, sha, small_h3, write

CANON = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}


@pytest.fixture
def int8_file(tmp_path) -> Path:
    src = write(tmp_path / "in.safetensors", small_h3())
    out = tmp_path / "int8.safetensors"
    convert(src, out, ConvertOptions())
    return out


# ----------------------------------------------------------------------------- sharded
def test_sharded_input_gives_sharded_output(tmp_path):
    from h3quant.formats.int8.tensors import encode_int8

    t = small_h3()
    d = make_sharded(tmp_path / "in", t)
    out = tmp_path / "out"
    convert(d, out, ConvertOptions())
    in_files = sorted(p.name for p in d.iterdir())
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, *in_files])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["note"] == "kept"
    with Checkpoint(out) as ck:
        assert not [f for f in ck.findings if f.severity.name == "ERROR"]
        assert set(index["weight_map"]) == set(ck.tensors)
        assert index["metadata"]["total_size"] == sum(
            i.nbytes for i in ck.tensors.values())
        for name in block_linears():
            q, s = encode_int8(t[name + ".weight"], convrot=True, group_size=256)
            assert torch.equal(ck.read(name + ".weight"), q)
            # a layer's new tensors live in the shard that held its weight
            home = ck.info(name + ".weight").file.name
            assert ck.info(name + ".weight_scale").file.name == home
            assert ck.info(name + MARKER_SUFFIX).file.name == home
        with Checkpoint(d) as ick:
            for name, info in ick.tensors.items():
                if name.rsplit(".", 1)[0] not in block_linears():
                    assert ck.info(name).file.name == info.file.name
                    assert bytes(ck.read_bytes(name)) == bytes(ick.read_bytes(name))
        # every shard carries the full quantization table, and its own metadata
        for sf in ck.files:
            assert set(parse_header_metadata(sf.metadata)) == set(block_linears())
        assert {sf.metadata["shard"] for sf in ck.files} == {"0", "1"}


# ----------------------------------------------------------------------------- bf16 / re-emit
def test_int8_to_bf16_round_trip(int8_file, tmp_path):
    out = tmp_path / "bf16.safetensors"
    report = convert(int8_file, out, ConvertOptions(target="bf16"))
    assert report.counts["convert"] == 8
    got, meta, _ = read_all(out)
    orig = small_h3()
    assert HEADER_KEY not in meta
    assert not [n for n in got if n.endswith((MARKER_SUFFIX, ".weight_scale"))]
    assert set(got) == set(orig)
    for name in block_linears():
        w, r = orig[name + ".weight"].float(), got[name + ".weight"]
        assert r.dtype == torch.bfloat16
        rel = ((w - r.float()).norm() / w.norm()).item()
        assert 0 < rel < 0.02
    for name in orig:
        if name.rsplit(".", 1)[0] not in block_linears():
            assert torch.equal(got[name], orig[name])


def test_canonical_int8_is_re_emitted_byte_for_byte(int8_file, tmp_path):
    out = tmp_path / "again.safetensors"
    report = convert(int8_file, out, ConvertOptions(target="int8-convrot"))
    assert report.identity and report.counts["keep"] == 8
    assert sha(out) == sha(int8_file)


def test_header_repair_missing_and_disagreeing(int8_file, tmp_path):
    _, meta, raw = read_all(int8_file)
    missing = resave(int8_file, tmp_path / "nohdr.safetensors",
                      metadata={k: v for k, v in meta.items() if k != HEADER_KEY})
    plan = plan_convert(missing, tmp_path / "o1.safetensors", ConvertOptions())
    assert any("missing" in r and HEADER_KEY in r for r in plan.repairs)
    logs: list[str] = []
    out1 = tmp_path / "o1.safetensors"
    convert(missing, out1, ConvertOptions(), log=logs.append)
    assert any("repair" in line for line in logs)
    _, meta1, raw1 = read_all(out1)
    assert parse_header_metadata(meta1) == parse_header_metadata(meta)
    assert all(raw1[n] == raw[n] for n in raw)  # every tensor byte-identical

    bad_layers = parse_header_metadata(meta)
    bad_layers["blocks.0.mlp.fc1"] = {"format": "int8_tensorwise", "convrot": False}
    disagree = resave(int8_file, tmp_path / "dis.safetensors",
                       metadata=dict(meta, **{HEADER_KEY: header_metadata_value(bad_layers)}))
    out2 = tmp_path / "o2.safetensors"
    # a header that disagrees with the marker tensor is validate's M110: refused, not guessed
    from h3quant.errors import FindingError

    with pytest.raises(FindingError, match="M110"):
        convert(disagree, out2, ConvertOptions())
    assert not out2.exists()


def test_markers_with_extra_fields_and_header_only_markers(int8_file, tmp_path):
    extra = dict(CANON, orig_dtype="torch.bfloat16", per_row=True)

    def add_extra(tensors, meta):
        layers = {}
        for n in block_linears():
            tensors[n + MARKER_SUFFIX] = marker_tensor(extra)
            layers[n] = extra
        meta[HEADER_KEY] = header_metadata_value(layers)

    src = resave(int8_file, tmp_path / "extra.safetensors", edit=add_extra)
    out = tmp_path / "o.safetensors"
    report = convert(src, out, ConvertOptions())
    assert report.counts["keep"] == 8 and not report.identity
    assert any("normalised" in n for lay in report.layers for n in lay.get("notes", []))
    _, meta, raw = read_all(out)
    _, _, raw0 = read_all(int8_file)
    for n in block_linears():
        assert json.loads(raw[n + MARKER_SUFFIX]) == CANON
        assert raw[n + ".weight"] == raw0[n + ".weight"]
    assert parse_header_metadata(meta) == dict.fromkeys(block_linears(), CANON)

    def drop_markers(tensors, meta):
        for n in block_linears():
            del tensors[n + MARKER_SUFFIX]

    header_only = resave(int8_file, tmp_path / "hdr.safetensors", edit=drop_markers)
    out2 = tmp_path / "o2.safetensors"
    report = convert(header_only, out2, ConvertOptions())
    assert any("written from header" in r for r in report.repairs)
    _, meta2, raw2 = read_all(out2)
    assert all(json.loads(raw2[n + MARKER_SUFFIX]) == CANON for n in block_linears())


def test_broken_marker_without_header_is_refused(int8_file, tmp_path):
    def nul(tensors, meta):
        tensors["blocks.0.mlp.fc2" + MARKER_SUFFIX] = torch.zeros(72, dtype=torch.uint8)

    src = resave(int8_file, tmp_path / "nul.safetensors",
                  metadata={"x": "y"}, edit=nul)
    with pytest.raises(FormatError, match="no usable quantization marker") as info:
        plan_convert(src, tmp_path / "o.safetensors", ConvertOptions())
    assert info.value.tensor == "blocks.0.mlp.fc2" and info.value.exit_code == 2


def test_fp8_input_layer_is_decoded_then_converted(tmp_path):
    """A ComfyUI float8_e4m3fn layer (marker + weight_scale) is taken in: decoded exactly
    (code x scale, in fp32), then encoded; its marker is not written."""
    t = small_h3(blocks=1)
    w = t.pop("blocks.0.mlp.fc1.weight")
    codes = w.float().to(torch.float8_e4m3fn)
    t["blocks.0.mlp.fc1.weight"] = codes
    t["blocks.0.mlp.fc1.weight_scale"] = torch.tensor(0.5)
    t["blocks.0.mlp.fc1" + MARKER_SUFFIX] = marker_tensor({"format": "float8_e4m3fn"})
    src = write(tmp_path / "fp8.safetensors", t)
    convert(src, tmp_path / "o.safetensors", ConvertOptions(target="bf16", report=False))
    tensors, _, _ = read_all(tmp_path / "o.safetensors")
    assert torch.equal(tensors["blocks.0.mlp.fc1.weight"],
                       (codes.float() * 0.5).to(torch.bfloat16))
    assert "blocks.0.mlp.fc1" + MARKER_SUFFIX not in tensors


# ----------------------------------------------------------------------------- W4A8
W4A8_SET = {"weight", "weight_s_rel", "weight_s_channel", "weight_codebook", "comfy_quant"}


@pytest.mark.slow
def test_w4a8_output_tensor_set_and_error(tmp_path):
    from h3quant.formats.w4a8.tensors import decode_w4a8
    from h3quant.formats.w4a8.codec import w4a8_marker

    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    out = tmp_path / "w4.safetensors"
    report = convert(src, out, ConvertOptions(target="w4a8", workers=2))
    got, meta, raw = read_all(out)
    orig = small_h3(blocks=1)
    for name in block_linears(1):
        suffixes = {n[len(name) + 1:] for n in got if n.startswith(name + ".")}
        assert suffixes == W4A8_SET
        assert "weight_correction" not in suffixes
        n, k = orig[name + ".weight"].shape
        assert got[name + ".weight"].dtype == torch.int8
        assert got[name + ".weight"].shape == (n, k // 2)
        assert got[name + ".weight_s_rel"].dtype == torch.float8_e4m3fn
        assert got[name + ".weight_s_channel"].shape == (n,)
        assert json.loads(raw[name + MARKER_SUFFIX]) == w4a8_marker()
        local = {s: got[f"{name}.{s}"] for s in W4A8_SET - {"comfy_quant"}}
        w_hat = decode_w4a8(local)
        w = orig[name + ".weight"].float()
        assert ((w - w_hat).norm() / w.norm()).item() < 0.2
    assert parse_header_metadata(meta) == dict.fromkeys(block_linears(1), w4a8_marker())
    assert all(lay["metrics"]["weight_rel_l2"] < 0.2 for lay in report.layers)
    # row chunks on the workers or all on one thread: the same bytes
    out1 = tmp_path / "w4_1.safetensors"
    convert(src, out1, ConvertOptions(target="w4a8", workers=1, report=False))
    assert sha(out1) == sha(out)


@pytest.mark.slow
def test_w4a8_layer_row_chunks_run_on_the_workers(tmp_path, monkeypatch):
    """One W4A8 layer at a time, its row chunks spread over the workers (after the codebook
    choice): several threads encode, and the bytes equal a one-thread run."""
    import threading

    from h3quant.formats.w4a8 import tensors as W

    monkeypatch.setattr(W, "_ROW_ELEM_BUDGET", 4096)  # many chunks per tiny layer
    threads: dict[int, set[str]] = {}  # per layer (its DecodedLevels table): encoding threads
    keep = []
    real = W.encode_groups

    def spy(xt, n, index, search, levels, *args, **kwargs):
        keep.append(levels)
        threads.setdefault(id(levels), set()).add(threading.current_thread().name)
        return real(xt, n, index, search, levels, *args, **kwargs)

    monkeypatch.setattr(W, "encode_groups", spy)
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    par, one = tmp_path / "par.safetensors", tmp_path / "one.safetensors"
    convert(src, par, ConvertOptions(target="w4a8", workers=3, report=False))
    assert len(threads) == len(block_linears(1))
    assert any(len(names) >= 2 for names in threads.values())  # old design: one thread per layer
    threads.clear()
    convert(src, one, ConvertOptions(target="w4a8", workers=1, report=False))
    assert all(names == {"MainThread"} for names in threads.values())
    assert sha(par) == sha(one)


@pytest.mark.slow
def test_int8_to_w4a8_and_back_through_the_int8_grid(int8_file, tmp_path):
    """int8 -> W4A8 re-encodes; W4A8 -> int8 ConvRot (same group) takes the decoded int8 grid
    the runtime multiplies (codes w8, scale s_channel: FORMATS.md 9), no requantization."""
    from h3quant.formats.int8.tensors import decode_int8
    from h3quant.formats.w4a8.tensors import decode_w4a8, decode_w4a8_int8

    w4 = tmp_path / "w4.safetensors"
    convert(int8_file, w4, ConvertOptions(target="w4a8"))
    got, _, _ = read_all(w4)
    assert all(f"{n}.weight_scale" not in got for n in block_linears())
    back = tmp_path / "back.safetensors"
    convert(w4, back, ConvertOptions(target="int8-convrot"))
    final, _, _ = read_all(back)
    name = "blocks.1.attn.qkv_proj"
    local = {s: got[f"{name}.{s}"] for s in W4A8_SET - {"comfy_quant"}}
    q = decode_w4a8_int8(local["weight"], local["weight_s_rel"], group_size=16,
                         codebook=local["weight_codebook"])
    assert torch.equal(final[name + ".weight"], q)
    assert torch.equal(final[name + ".weight_scale"], local["weight_s_channel"].reshape(-1, 1))
    i8, _, _ = read_all(int8_file)
    ref = decode_int8(i8[name + ".weight"], i8[name + ".weight_scale"], convrot=True)
    w4_hat = decode_w4a8(local)
    assert ((ref - w4_hat).norm() / ref.norm()).item() < 0.2


# ----------------------------------------------------------------------------- oracle
def test_comfy_kitchen_accepts_our_int8_tensors(int8_file):
    """Kitchen's TensorWiseINT8Layout takes our (weight, per-row scale) as stored, dequantizes
    them like our decode_int8, and quantizes the source weight to the same codes."""
    pytest.importorskip("comfy_kitchen")
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    from h3quant.formats.int8.tensors import decode_int8

    got, _, _ = read_all(int8_file)
    orig = small_h3()
    for name in ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2"):
        q, s = got[name + ".weight"], got[name + ".weight_scale"]
        params = TensorWiseINT8Layout.Params(scale=s, orig_dtype=torch.float32,
                                             orig_shape=tuple(q.shape), convrot=True,
                                             convrot_groupsize=256)
        theirs = QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize()
        ours = decode_int8(q, s, convrot=True, group_size=256, dtype=torch.float32)
        torch.testing.assert_close(theirs.float(), ours, rtol=1e-5, atol=1e-7)
        ref = QuantizedTensor.from_float(orig[name + ".weight"].float(), "TensorWiseINT8Layout",
                                         per_channel=True, convrot=True, convrot_groupsize=256)
        assert torch.equal(ref._qdata, q)
        assert torch.equal(ref._params.scale.reshape(-1, 1), s)


def test_tensorwise_int8_input_is_reencoded_per_row(tmp_path):
    from h3quant.formats.int8.tensors import decode_int8, encode_int8
    from h3quant.formats.int8.codec import int8_marker

    t = small_h3(blocks=1)
    w = t.pop("blocks.0.mlp.fc1.weight")
    q, s = encode_int8(w, convrot=False, per_row=False)
    assert s.dim() == 0
    t["blocks.0.mlp.fc1.weight"], t["blocks.0.mlp.fc1.weight_scale"] = q, s
    t["blocks.0.mlp.fc1" + MARKER_SUFFIX] = marker_tensor(int8_marker(convrot=False))
    src = write(tmp_path / "tw.safetensors", t)
    out = tmp_path / "o.safetensors"
    report = convert(src, out, ConvertOptions(target="int8"))
    acts = {lay["name"]: lay for lay in report.layers}
    assert acts["blocks.0.mlp.fc1"]["action"] == "convert"
    assert acts["blocks.0.mlp.fc1"]["from"] == "int8_tensorwise"
    got, _, _ = read_all(out)
    q2, s2 = encode_int8(decode_int8(q, s, convrot=False), convrot=False, per_row=True)
    assert torch.equal(got["blocks.0.mlp.fc1.weight"], q2)
    assert torch.equal(got["blocks.0.mlp.fc1.weight_scale"], s2)


def test_sharded_overwrite_replaces_the_directory(tmp_path):
    d = make_sharded(tmp_path / "in", small_h3(blocks=1))
    out = tmp_path / "out"
    convert(d, out, ConvertOptions(report=False))
    first = {p.name: p.stat().st_ino for p in out.iterdir()}
    convert(d, out, ConvertOptions(overwrite=True, report=False))  # h3quant's own output
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, *first_names(d)])
    assert {p.name: p.stat().st_ino for p in out.iterdir()} != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    # a directory holding anything h3quant did not write is never replaced
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="did not write"):
        convert(d, out, ConvertOptions(overwrite=True, report=False))
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def first_names(d):
    return [p.name for p in d.iterdir()]
