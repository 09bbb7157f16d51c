"""Container and shard rules through `h3quant validate`: forged files, golden bytes, I/O errors."""

import hashlib
import json
import os
import random
import struct
from pathlib import Path

import pytest
import torch

from helpers.forge import cli, codes, expect_error, float_layer, layout, raw_file, save, simple, validate
from h3quant.formats.container.writer import save_tensors

DATA = Path(__file__).resolve().parents[2] / "data"


# ----------------------------------------------------------------------------- header


def test_legal_minimal_float_file_passes(tmp_path):
    res, doc = validate(simple(tmp_path / "ok.safetensors"))
    assert res.exit_code == 0, doc
    assert doc["ok"] is True and doc["counts"]["error"] == 0
    assert doc["checked"]["tensors"] == 2


def test_file_shorter_than_8_bytes(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    doc = expect_error(p, "C101")
    assert "too short" in doc["findings"][0]["message"]


def test_huge_header_length(tmp_path):
    doc = expect_error(raw_file(tmp_path / "h.safetensors", b"{}      ", length=1 << 40), "C101")
    assert "exceeds" in doc["findings"][0]["message"]


def test_header_past_end_of_file(tmp_path):
    p = raw_file(tmp_path / "h.safetensors", b"{}      ", length=8 + 100)
    doc = expect_error(p, "C101")
    assert "past the end" in doc["findings"][0]["message"]


def test_non_utf8_header(tmp_path):
    expect_error(raw_file(tmp_path / "u.safetensors", b'{"a\xff":1}    '), "C102")


def test_non_json_header(tmp_path):
    expect_error(raw_file(tmp_path / "j.safetensors", b"{not json"), "C103")


def test_json_array_header(tmp_path):
    doc = expect_error(raw_file(tmp_path / "a.safetensors", b"[1, 2, 3]"), "C103")
    assert "list" in doc["findings"][0]["message"]


def test_fatal_header_stops_after_container_stage(tmp_path):
    _, doc = validate(raw_file(tmp_path / "a.safetensors", b"[1, 2, 3]"))
    assert doc["checked"]["stages"] == ["container"]
    assert codes(doc) == {"C103"}


def _set(name, key, value):
    def mutate(h):
        h[name][key] = value
    return mutate


@pytest.mark.parametrize("mutate, code", [
    (_set("a.weight", "dtype", "F17"), "C105"),
    (_set("a.weight", "shape", [-2, -4]), "C104"),
    (_set("a.weight", "shape", [2.0, 4]), "C104"),
    (_set("a.weight", "shape", "2x4"), "C104"),
    (lambda h: h["a.weight"].pop("data_offsets"), "C104"),
    (lambda h: h.__setitem__("a.weight", [1, 2]), "C104"),
    (_set("a.weight", "shape", [2, 3]), "C107"),
    (_set("a.weight", "data_offsets", [32, 0]), "C106"),
    (_set("b.weight", "data_offsets", [0, 16]), "C108"),
    (lambda h: h.__setitem__("__metadata__", {"k": 1}), "C110"),
    (lambda h: h.__setitem__("__metadata__", ["k"]), "C110"),
], ids=["bad-dtype", "negative-shape", "float-shape", "string-shape", "no-offsets",
        "entry-not-object", "byte-length", "offsets-reversed", "overlap", "metadata-value",
        "metadata-list"])
def test_forged_header_entries(tmp_path, mutate, code):
    doc = expect_error(simple(tmp_path / "f.safetensors", mutate), code)
    hit = [f for f in doc["findings"] if f["code"] == code][0]
    assert hit["file"].endswith("f.safetensors")


def test_truncated_buffer(tmp_path):
    doc = expect_error(simple(tmp_path / "t.safetensors", cut=4), "C109")
    assert "truncated" in [f for f in doc["findings"] if f["code"] == "C109"][0]["message"]


def test_gap_between_tensors(tmp_path):
    def gap(h):
        h["b.weight"]["data_offsets"] = [40, 56]
    doc = expect_error(simple(tmp_path / "g.safetensors", gap, data_extra=bytes(8)), "C111")
    assert any("unused bytes" in f["message"] for f in doc["findings"])


def test_trailing_bytes(tmp_path):
    doc = expect_error(simple(tmp_path / "t.safetensors", data_extra=bytes(8)), "C111")
    assert any("trailing" in f["message"] for f in doc["findings"])


def test_unpadded_header_is_only_a_warning(tmp_path):
    header, data = layout({"a.weight": ("F32", [2])})
    hb = json.dumps(header, separators=(",", ":")).encode()
    assert len(hb) % 8  # the forge must really be unpadded
    res, doc = validate(raw_file(tmp_path / "p.safetensors", hb, data))
    assert res.exit_code == 0
    assert codes(doc) - {"T104"} == {"C113"}


def test_random_corruption_never_tracebacks(tmp_path):
    src = tmp_path / "src.safetensors"
    save(src, {**float_layer("a", 4, 16), "b": torch.arange(4, dtype=torch.int8)})
    raw = src.read_bytes()
    rng = random.Random(1234)
    for i in range(40):
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf) if i % 2 else 80)] = rng.randrange(256)
        p = tmp_path / f"c{i}.safetensors"
        p.write_bytes(bytes(buf[: rng.randint(0, len(buf))] if i % 5 == 0 else buf))
        res = cli("validate", p, "--json", "--deep")
        assert res.exit_code in (0, 1)


# ----------------------------------------------------------------------------- I/O (exit 2)


def test_missing_file_is_exit_2(tmp_path):
    res = cli("validate", tmp_path / "nope.safetensors")
    assert res.exit_code == 2
    assert "no such file" in res.stderr


def test_missing_index_is_exit_2(tmp_path):
    res = cli("validate", tmp_path / "model.safetensors.index.json")
    assert res.exit_code == 2


def test_empty_directory_is_exit_2(tmp_path):
    res = cli("validate", tmp_path)
    assert res.exit_code == 2
    assert "no .safetensors" in res.stderr


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file_is_exit_2(tmp_path):
    p = simple(tmp_path / "x.safetensors")
    p.chmod(0)
    try:
        res = cli("validate", p)
    finally:
        p.chmod(0o644)
    assert res.exit_code == 2


def test_usage_without_ckpt_is_exit_2():
    res = cli("validate")
    assert res.exit_code == 2


# ----------------------------------------------------------------------------- shards


def _shards(tmp_path, *, drop_file=False, extra_listed=False, duplicate=False, unlisted=False):
    a = float_layer("a", 4, 16, seed=1)
    b = float_layer("b", 4, 16, bias=True, seed=2)
    if duplicate:
        b.update(a)
    save(tmp_path / "model-00001-of-00002.safetensors", a)
    save(tmp_path / "model-00002-of-00002.safetensors", b)
    wm = {n: "model-00001-of-00002.safetensors" for n in a}
    wm.update({n: "model-00002-of-00002.safetensors" for n in ("b.weight", "b.bias")})
    if extra_listed:
        wm["c.weight"] = "model-00001-of-00002.safetensors"
    if unlisted:
        wm.pop("b.bias")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    if drop_file:
        (tmp_path / "model-00002-of-00002.safetensors").unlink()
    return index


def test_sharded_ok_by_index_and_directory(tmp_path):
    index = _shards(tmp_path)
    for target in (index, tmp_path):
        res, doc = validate(target)
        assert res.exit_code == 0, doc
        assert doc["checked"]["files"] == 2 and doc["checked"]["tensors"] == 3


def test_shard_missing(tmp_path):
    expect_error(_shards(tmp_path, drop_file=True), "S102")


def test_tensor_listed_but_absent(tmp_path):
    doc = expect_error(_shards(tmp_path, extra_listed=True), "S103")
    assert any(f["tensor"] == "c.weight" for f in doc["findings"])


def test_tensor_duplicated_across_shards(tmp_path):
    doc = expect_error(_shards(tmp_path, duplicate=True), "S104")
    assert any(f["tensor"] == "a.weight" for f in doc["findings"] if f["code"] == "S104")


def test_unlisted_tensor_is_a_warning(tmp_path):
    res, doc = validate(_shards(tmp_path, unlisted=True))
    assert res.exit_code == 0 and "S105" in codes(doc)
    assert [f["tensor"] for f in doc["findings"] if f["code"] == "S105"] == ["b.bias"]


def test_index_not_json(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{weight_map")
    expect_error(index, "S101")


# ----------------------------------------------------------------------------- golden bytes


GOLDEN_SHA256 = "9c5eef4a06f305a347fb3f826925654db6b48ea321c00b44f5e3faa4dc70083d"


def _golden_tensors():
    return {
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
        "d.mask": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "b": torch.tensor([1, -2, 3, -128], dtype=torch.int8),
        "c": torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16),
    }


def test_golden_bytes(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    p = tmp_path / "golden.safetensors"
    save_tensors(p, _golden_tensors(), {"format": "pt"})
    raw = p.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_SHA256
    assert raw == st.save(_golden_tensors(), metadata={"format": "pt"})
    assert raw == (DATA / "golden_tiny.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and json.loads(raw[8 : 8 + n])["__metadata__"] == {"format": "pt"}


def test_float_value_reads_each_float_dtype_as_torch_stores_it():
    """One value from raw little-endian bytes, without torch, equals what torch stored."""
    from h3quant.formats.container.dtypes import float_value, from_torch

    values = [0.0, -0.0, 1.0, -2.5, 3.140625, 65504.0, 1e-3, float("inf")]
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        for v in values:
            t = torch.tensor([v, 7.0], dtype=dtype)
            raw = t.view(torch.uint8).numpy().tobytes()
            got = float_value(raw, from_torch(dtype))
            assert got == float(t[0]) and str(got) == str(float(t[0])), (dtype, v, got)
    assert float_value(b"\x01", "I8") is None and float_value(b"\x01", "F8_E4M3") is None
