"""`h3quant inspect`: header-only summaries, pinned JSON shape, no tensor data read."""

import json
import random
import struct

import pytest

from helpers.forge import cli, float_layer, int8_layer, quantized_synth, save, simple, w4a8_layer
from h3quant.sizes import mb_number, size_text
from h3quant.formats.container import reader as container
from h3quant.h3.topology import is_h3_block_linear
from h3quant.pipelines.headers.inspect import inspect_checkpoint

TOP_KEYS = ["path", "index", "sharded", "files", "total_bytes", "tensor_count", "parameters",
            "dtypes", "formats", "layer_counts", "bits_per_weight", "topology", "naming",
            "metadata_keys", "findings", "notes", "bytes_read", "layers", "mix", "loads"]
LAYER_KEYS = ["name", "format", "N", "K", "dtypes", "bits_per_weight", "source", "bytes",
              "layout", "nz"]


@pytest.fixture(scope="module")
def h3_markers_only(tmp_path_factory):
    return quantized_synth(tmp_path_factory.mktemp("h3m") / "h3_int8_t.safetensors", header=False)


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    obj = json.loads(raw[8 : 8 + n])
    obj.pop("__metadata__", None)
    return obj


def _inspect_json(path, *extra):
    res = cli("inspect", path, "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


class _Counter:
    """Counts SafetensorsFile.read / read_bytes / iter_bytes calls and the names they read."""

    def __init__(self, monkeypatch):
        self.names = []
        for meth in ("read", "read_bytes", "iter_bytes"):
            orig = getattr(container.SafetensorsFile, meth)

            def spy(sf, info, *a, _orig=orig, **kw):
                self.names.append(info.name)
                return _orig(sf, info, *a, **kw)

            monkeypatch.setattr(container.SafetensorsFile, meth, spy)


# ----------------------------------------------------------------------------- shape


def test_json_shape_is_pinned(h3):
    doc = _inspect_json(h3, "--layers")
    assert list(doc) == TOP_KEYS
    assert all(list(row) == LAYER_KEYS for row in doc["layers"])
    assert set(doc["bits_per_weight"]) == {"all", "quantized"}
    assert set(doc["layer_counts"]) == {"layers", "quantized", "other_tensors"}
    assert set(doc["findings"]) == {"error", "warning", "info"}
    assert all(set(f) == {"path", "size"} for f in doc["files"])
    assert all(set(v) == {"tensors", "bytes"} for v in doc["dtypes"].values())
    assert all(set(v) == {"layers", "bytes"} for v in doc["formats"].values())
    assert _inspect_json(h3)["layers"] is None


def test_numbers_match_the_header(h3):
    doc = _inspect_json(h3, "--layers")
    header = _header(h3)
    assert doc["tensor_count"] == len(header)
    assert doc["total_bytes"] == h3.stat().st_size == doc["files"][0]["size"]
    census = {}
    for e in header.values():
        b, eb = e["data_offsets"]
        c = census.setdefault(e["dtype"], {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += eb - b
    assert doc["dtypes"] == census

    linears = {n[: -len(".weight")]: e["shape"] for n, e in header.items()
               if n.endswith(".weight") and e["dtype"] == "I8"}
    assert len(linears) == 8 and all(is_h3_block_linear(n) for n in linears)
    assert doc["formats"]["int8_tensorwise"]["layers"] == 8
    nk = sum(n * k for n, k in linears.values())
    qbytes = sum(n * k + 4 * n for n, k in linears.values())
    assert doc["bits_per_weight"]["quantized"] == pytest.approx(8 * qbytes / nk, abs=1e-3)
    marker_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for n, e in header.items()
                       if n.endswith(".comfy_quant"))
    data = h3.stat().st_size - 8 - struct.unpack("<Q", h3.read_bytes()[:8])[0] - marker_bytes
    assert doc["bits_per_weight"]["all"] == pytest.approx(8 * data / doc["parameters"], abs=1e-3)
    assert doc["layer_counts"]["quantized"] == 8
    rows = {r["name"]: r for r in doc["layers"]}
    qkv = rows["blocks.0.attn.qkv_proj"]
    assert (qkv["format"], qkv["N"], qkv["K"]) == ("int8_tensorwise", 1536, 512)
    assert qkv["source"] == "header+tensor"
    assert qkv["dtypes"] == {"comfy_quant": "U8", "weight": "I8", "weight_scale": "F32"}


def test_topology_summary(h3):
    topo = _inspect_json(h3)["topology"]
    assert topo["detected"] is True and topo["preset"] == "tiny"
    assert topo["block_linears"] == {"total": 8, "quantized": 8,
                                     "formats": {"int8_tensorwise": 8}}
    doc = _inspect_json(simple(h3.parent / "plain.safetensors"))
    assert doc["topology"] is None


def test_no_mmap_gives_identical_output(h3):
    assert _inspect_json(h3, "--layers") == _inspect_json(h3, "--layers", "--no-mmap")


# ----------------------------------------------------------------------------- reads


def test_reads_no_tensor_data_with_header_metadata(h3, monkeypatch):
    spy = _Counter(monkeypatch)
    res = inspect_checkpoint(h3, layers=True)
    assert spy.names == [] and res.bytes_read == 0
    assert res.layer_counts["quantized"] == 8


def test_reads_only_markers_without_header_metadata(h3_markers_only, monkeypatch):
    spy = _Counter(monkeypatch)
    res = inspect_checkpoint(h3_markers_only)
    assert spy.names and all(n.endswith(".comfy_quant") for n in spy.names)
    header = _header(h3_markers_only)
    expected = sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in spy.names)
    assert res.bytes_read == expected == 8 * 72
    assert res.findings["warning"] >= 1  # M113: no header metadata


def test_read_data_reads_every_marker(h3, monkeypatch):
    spy = _Counter(monkeypatch)
    res = inspect_checkpoint(h3, read_data=True)
    assert len(spy.names) == 8 and res.bytes_read == 8 * 72


@pytest.mark.parametrize("mmap", [True, False])
def test_garbage_data_region_is_never_looked_at(h3, tmp_path, mmap):
    raw = bytearray(h3.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    rng = random.Random(0)
    raw[8 + n :] = rng.randbytes(len(raw) - 8 - n)
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(bytes(raw))
    a = inspect_checkpoint(h3, layers=True).to_dict()
    b = inspect_checkpoint(bad, layers=True, mmap=mmap).to_dict()
    a.pop("path"), b.pop("path"), a.pop("files"), b.pop("files")
    assert a == b


# ----------------------------------------------------------------------------- text and errors


def test_text_output(h3):
    res = cli("inspect", h3, "--layers")
    assert res.exit_code == 0
    out = res.stdout
    assert "int8_tensorwise" in out and "MB" in out and "preset=tiny" in out
    assert "blocks.1.mlp.fc2" in out
    bpw = _inspect_json(h3)["bits_per_weight"]
    assert f"{bpw['all']:.2f} overall, {bpw['quantized']:.2f} in quantized" in out
    assert "0 bytes" in out


def test_w4a8_and_float_layers(tmp_path):
    t = {**w4a8_layer("a", 8, 256), **int8_layer("b", 8, 256), **float_layer("c", 8, 256)}
    res = inspect_checkpoint(save(tmp_path / "m.safetensors", t), layers=True)
    assert set(res.formats) == {"asym_w4a8_int8", "int8_tensorwise", "BF16"}
    rows = {r["name"]: r for r in res.layers}
    assert rows["a"]["K"] == 256 and rows["a"]["bits_per_weight"] == pytest.approx(
        8 * (8 * 128 + 8 * 16 + 32 + 64) / (8 * 256), abs=1e-3)
    assert rows["c"]["bits_per_weight"] == 16.0


def test_one_size_style():
    """GB from 1 GB up, MB below, two decimals, decimal units; bare MB numbers for columns."""
    assert size_text(20_970_000_000) == "20.97 GB"
    assert size_text(999_999_999) == "1.00 GB" and size_text(994_000_000) == "994.00 MB"
    assert size_text(33_512_345) == "33.51 MB" and size_text(5000) == "0.01 MB"
    assert size_text(1500) == "<0.01 MB" and size_text(0) == "0.00 MB"
    assert mb_number(33_512_345) == "33.51"


def test_broken_container_is_a_clear_error(tmp_path):
    res = cli("inspect", simple(tmp_path / "t.safetensors", cut=4))
    assert res.exit_code == 2
    assert "C109" in res.stderr and "validate" in res.stderr


def test_missing_file(tmp_path):
    res = cli("inspect", tmp_path / "none.safetensors")
    assert res.exit_code == 2 and "no such file" in res.stderr


def test_help_has_examples():
    res = cli("inspect", "--help")
    assert "Examples" in res.stdout and "--layers" in res.stdout and "--no-mmap" in res.stdout


def test_sharded_index(tmp_path):
    a, b = int8_layer("a"), float_layer("b", 4, 16)
    save(tmp_path / "m-1.safetensors", a)
    save(tmp_path / "m-2.safetensors", b)
    wm = {**{n: "m-1.safetensors" for n in a}, **{n: "m-2.safetensors" for n in b}}
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": wm}))
    doc = _inspect_json(index)
    assert doc["sharded"] is True and doc["index"] == str(index)
    assert [f["path"] for f in doc["files"]] == [str(tmp_path / "m-1.safetensors"),
                                                 str(tmp_path / "m-2.safetensors")]
    assert doc["total_bytes"] == sum(f["size"] for f in doc["files"])
    assert doc["tensor_count"] == len(wm) and doc["layer_counts"]["quantized"] == 1
    assert "file" in cli("inspect", index).stdout  # the per-file table
