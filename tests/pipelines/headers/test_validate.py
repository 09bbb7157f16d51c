"""`h3quant validate`: stages, topology, --deep data checks, JSON shape, codes, robustness."""

import json

import pytest
import torch

import h3quant.formats.deep as deep
import h3quant.pipelines.headers.validate as vmod
from helpers.forge import (
    cli,
    codes,
    expect_error,
    float_layer,
    int8_layer,
    save,
    validate,
    w4a8_layer,
)
from h3quant.findings import all_rules
from h3quant.formats.container import reader as container
from h3quant.pipelines.headers.validate import validate_checkpoint
from h3quant.synth import synth_checkpoint

KEYS = ["path", "ok", "deep", "counts", "checked", "findings", "loads", "loader"]


@pytest.fixture(scope="module")
def h3_plain(tmp_path_factory):
    p = tmp_path_factory.mktemp("h3p") / "h3.safetensors"
    synth_checkpoint(p, preset="tiny")
    return p


# ----------------------------------------------------------------------------- whole files


def test_synth_plain_passes_with_topology(h3_plain):
    res, doc = validate(h3_plain, "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert list(doc) == KEYS
    assert doc["findings"] == [] and doc["deep"] is True
    assert doc["checked"]["topology"]["preset"] == "tiny"
    assert doc["checked"]["stages"] == ["container", "markers", "schemes", "topology", "deep"]


def test_synth_int8_passes_deep(h3):
    res, doc = validate(h3, "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert doc["checked"]["quantized_layers"] == 8
    assert doc["checked"]["topology"]["block_linears"]["quantized"] == 8


def test_no_mmap_identical(h3):
    a = validate_checkpoint(h3, deep=True).to_dict()
    b = validate_checkpoint(h3, deep=True, mmap=False).to_dict()
    assert a == b


def test_topology_findings_integrated(h3, tmp_path):
    from h3quant.formats.container.checkpoint import Checkpoint

    with Checkpoint(h3) as ck:
        t = {n: ck.read(n).clone() for n in ck.tensors if n != "blocks.1.norm2.weight"}
    name = "token_refiner.blocks.0.mlp.fc2"
    if f"{name}.weight" in t:
        n, k = t.pop(f"{name}.weight").shape
        t.update(int8_layer(name, n, k))
    doc = expect_error(save(tmp_path / "t.safetensors", t), "T101")
    found = {f["code"]: f for f in doc["findings"]}
    assert found["T101"]["tensor"] == "blocks.1.norm2.weight"
    assert "T105" in found


def test_not_h3_is_an_info_note(tmp_path):
    res, doc = validate(save(tmp_path / "x.safetensors", int8_layer("a")))
    assert res.exit_code == 0
    (t104,) = [f for f in doc["findings"] if f["code"] == "T104"]
    assert t104["severity"] == "info"


def test_text_output(tmp_path):
    t = int8_layer("a", scale_shape=(8, 2))
    res = cli("validate", save(tmp_path / "x.safetensors", t))
    assert res.exit_code == 1
    assert "ERROR   Q103 tensor-shape a.weight_scale:" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("FAILED: 1 errors")


# ----------------------------------------------------------------------------- deep


def _deep(tmp_path, tensors, code):
    p = save(tmp_path / "d.safetensors", tensors)
    res, doc = validate(p)
    assert code not in codes(doc)  # header-only validation cannot see it
    res, doc = validate(p, "--deep")
    assert code in codes(doc), doc["findings"]
    return res, doc


@pytest.mark.parametrize("value, code", [(float("nan"), "D101"), (float("inf"), "D101"),
                                         (0.0, "D102"), (-1.0, "D102")])
def test_int8_scale_values(tmp_path, value, code):
    t = int8_layer("a")
    t["a.weight_scale"][3, 0] = value
    res, doc = _deep(tmp_path, t, code)
    assert res.exit_code == 1
    hit = [f for f in doc["findings"] if f["code"] == code][0]
    assert hit["tensor"] == "a.weight_scale" and "index 3" in hit["message"]


def test_int8_minus_128_is_a_warning(tmp_path):
    t = int8_layer("a")
    t["a.weight"][0, :5] = -128
    res, doc = _deep(tmp_path, t, "D103")
    assert res.exit_code == 0
    assert "5 of 2048" in [f for f in doc["findings"] if f["code"] == "D103"][0]["message"]


@pytest.mark.parametrize("bits, code", [(0x7F, "D101"), (0x00, "D102"), (0x80, "D102")])
def test_w4a8_s_rel_bits(tmp_path, bits, code):
    t = w4a8_layer("a")
    s = t["a.weight_s_rel"].view(torch.uint8).clone()
    s[2, 5] = bits
    t["a.weight_s_rel"] = s.view(torch.float8_e4m3fn)
    res, _ = _deep(tmp_path, t, code)
    assert res.exit_code == 1


def test_w4a8_u8_s_rel_read_as_e4m3(tmp_path):
    t = w4a8_layer("a")
    s = t["a.weight_s_rel"].view(torch.uint8).clone()
    s[0, 0] = 0x7F  # NaN only when read as e4m3 (127 as a plain byte)
    t["a.weight_s_rel"] = s
    _deep(tmp_path, t, "D101")


def test_w4a8_s_channel(tmp_path):
    t = w4a8_layer("a")
    t["a.weight_s_channel"][1] = float("nan")
    _deep(tmp_path, t, "D101")


@pytest.mark.parametrize("mutate", [
    lambda c: c.flip(0),
    lambda c: c * 1.5,
    lambda c: torch.where(torch.arange(16) == 4, torch.tensor(float("nan")), c),
], ids=["unsorted", "outside", "nan"])
def test_codebook(tmp_path, mutate):
    t = w4a8_layer("a")
    t["a.weight_codebook"] = mutate(t["a.weight_codebook"])
    res, _ = _deep(tmp_path, t, "D104")
    assert res.exit_code == 1


def test_float_weight_nonfinite_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(deep, "CHUNK_BYTES", 64)  # 32 bf16 values per chunk
    t = float_layer("a", 8, 256)
    t["a.weight"][7, 200] = float("inf")
    t["a.weight"][7, 255] = float("nan")
    reads = []
    orig = deep.Stream.iter

    def spy(self, info, chunk):
        for part in orig(self, info, chunk):
            reads.append((info.name, len(part)))
            yield part

    monkeypatch.setattr(deep.Stream, "iter", spy)
    _, doc = _deep(tmp_path, t, "D106")
    assert [n for name, n in reads if name == "a.weight"] == [64] * (8 * 256 * 2 // 64)
    msg = [f for f in doc["findings"] if f["code"] == "D106"][0]["message"]
    assert f"2 of {8 * 256}" in msg and f"index {7 * 256 + 200}" in msg


def test_deep_reads_weights_in_bounded_chunks(h3, monkeypatch):
    monkeypatch.setattr(deep, "CHUNK_BYTES", 1 << 16)
    sizes = {}
    orig = deep.Stream.iter

    def spy(self, info, chunk):
        for part in orig(self, info, chunk):
            sizes[info.name] = sizes.get(info.name, 0) + len(part)
            assert len(part) <= 1 << 16
            yield part

    monkeypatch.setattr(deep.Stream, "iter", spy)
    via_reader = []
    orig_rb = container.SafetensorsFile.read_bytes

    def rb(sf, info, *a):
        via_reader.append(info.name)
        return orig_rb(sf, info, *a)

    monkeypatch.setattr(container.SafetensorsFile, "read_bytes", rb)
    res = validate_checkpoint(h3, deep=True)
    # only the markers go through the (possibly memory-mapped) reader; data is streamed
    assert res.ok and via_reader and all(n.endswith(".comfy_quant") for n in via_reader)
    with container.SafetensorsFile(h3) as sf:
        # every weight and scale was read in full, every byte once
        for name in ("blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.weight_scale",
                     "blocks.1.norm1.weight"):
            assert sizes[name] == sf.tensors[name].nbytes


def test_deep_short_read_is_a_finding(tmp_path, monkeypatch):
    t = {**float_layer("a"), **float_layer("b", seed=1)}
    p = save(tmp_path / "x.safetensors", t)
    res_ok = validate_checkpoint(p, deep=True)
    assert res_ok.ok
    from h3quant.formats.container.checkpoint import Checkpoint

    orig_init = Checkpoint.__init__

    def init_then_truncate(self, *a, **kw):
        orig_init(self, *a, **kw)
        with open(p, "r+b") as fh:  # the file shrinks after its header was read
            fh.truncate(p.stat().st_size - 100)

    monkeypatch.setattr(Checkpoint, "__init__", init_then_truncate)
    res = validate_checkpoint(p, deep=True)
    assert "C109" in {f.code for f in res.findings} and not res.ok


def test_deep_survives_a_failing_layer(tmp_path, monkeypatch):
    def boom(*a):
        raise RuntimeError("simulated read failure")

    monkeypatch.setattr(deep, "_check_int8_codes", boom)
    t = {**int8_layer("a"), **float_layer("b")}
    t["b.weight"][0, 0] = float("nan")
    res = validate_checkpoint(save(tmp_path / "x.safetensors", t), deep=True)
    got = {f.code for f in res.findings}
    assert {"X101", "D106"} <= got


# ----------------------------------------------------------------------------- robustness, codes


def test_unexpected_exception_becomes_a_finding(tmp_path, monkeypatch):
    def boom(layer):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(vmod, "check_layer", boom)
    doc = expect_error(save(tmp_path / "x.safetensors", int8_layer("a")), "X101")
    hit = [f for f in doc["findings"] if f["code"] == "X101"][0]
    assert "ZeroDivisionError" in hit["message"] and hit["tensor"] == "a"
    assert "T104" in codes(doc)  # later stages still ran


def test_codes_lists_the_registry():
    res = cli("validate", "--codes")
    assert res.exit_code == 0
    for r in all_rules():
        assert r.code in res.stdout and r.name in res.stdout
    doc = json.loads(cli("validate", "--codes", "--json").stdout)
    assert [d["code"] for d in doc] == [r.code for r in all_rules()]
    assert {"X101", "Q108"} <= {d["code"] for d in doc}


def test_help_documents_exit_codes():
    out = cli("validate", "--help").stdout
    assert "Exit status" in out and "--deep" in out and "--codes" in out and "Examples" in out
