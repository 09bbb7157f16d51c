"""GGUF files: read through the gguf package (Q8_0 / Q4_0 written by its own writer and
quantizers and decoded by its own dequantize; a Q4_K file written block by block here and
decoded by a decoder written here), ComfyUI's names and shapes, inspect / validate / convert."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers.gguf_files import q4k_decode, q4k_encode, write_gguf
from helpers.h3files import read_tensors as read_all

from h3quant.cli import main
from h3quant.errors import ContainerError
from h3quant.formats.gguf import GgufFile, is_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("gguf")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    tensors, _ = read_all(src)
    return {"dir": d, "src": src, "tensors": tensors}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_package_quants_read_back_as_the_package_decodes_them(tmp_path, qtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((6, 96)) * 0.1).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(a, t)
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), "minimax_h3")
    w.add_tensor("model.diffusion_model.blocks.0.mlp.fc2.weight", raw, raw_dtype=t)
    w.add_tensor("model.diffusion_model.blocks.0.mlp.fc2.bias", np.arange(6, dtype=np.float32))
    w.add_tensor("text_encoder.dropped", np.zeros(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert is_gguf(p)
    with GgufFile(p) as g:
        # the prefix of a full checkpoint is stripped; tensors outside it are not the model's
        assert sorted(g.tensors) == ["blocks.0.mlp.fc2.bias", "blocks.0.mlp.fc2.weight"]
        info = g.tensors["blocks.0.mlp.fc2.weight"]
        assert (info.qtype, info.shape) == (qtype, (6, 96))
        want = gguf.quants.dequantize(raw, t).reshape(6, 96)
        assert np.array_equal(g.read("blocks.0.mlp.fc2.weight"), want)
        assert np.abs(want - a).max() < (0.01 if qtype == "Q8_0" else 0.1)
        assert np.array_equal(g.read("blocks.0.mlp.fc2.bias"), np.arange(6, dtype=np.float32))
        assert g.architecture == "minimax_h3" and g.version == 3


def test_a_k_quant_written_block_by_block(tmp_path):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    raw = q4k_encode(a)
    assert raw.shape == (4, 2 * 144)
    p = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(p), "minimax_h3")
    w.add_tensor("blocks.0.attn.out_proj.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GgufFile(p) as g:
        got = g.read("blocks.0.attn.out_proj.weight")
        assert g.tensors["blocks.0.attn.out_proj.weight"].bits_per_weight == 4.5
    want = q4k_decode(raw, a.shape)
    assert np.array_equal(got, want)
    assert np.linalg.norm(got - a) / np.linalg.norm(a) < 0.15  # a real quantization of a


def test_forged_files_are_refused(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ContainerError, match="malformed GGUF header"):
        GgufFile(p)
    q = tmp_path / "no.gguf"
    q.write_bytes(b"GGUX" + b"\x00" * 40)
    assert not is_gguf(q)
    with pytest.raises(ContainerError, match="no GGUF magic"):
        GgufFile(q)
    r = CliRunner().invoke(main, ["validate", str(p), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["findings"][0]["code"] == "G101"
    r = CliRunner().invoke(main, ["inspect", str(p)])
    assert r.exit_code == 2 and "malformed GGUF header" in r.output


def test_inspect_validate_and_convert_read_an_h3_gguf(h3, tmp_path):
    f = tmp_path / "h3-Q8_0.gguf"
    write_gguf(h3["tensors"], f, "Q8_0")
    r = CliRunner().invoke(main, ["inspect", str(f), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["container"] == "gguf" and info["types"]["Q8_0"]["tensors"] == 4
    assert info["bits_per_weight"]["block_linears"] == 8.5
    assert info["topology"]["blocks"] == 1 and info["topology"]["hidden"] == 512
    r = CliRunner().invoke(main, ["validate", str(f), "--deep"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "int8.safetensors"
    r = CliRunner().invoke(main, ["convert", str(f), str(out), "--to", "int8-convrot",
                                  "--no-report", "-q"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3-Q8_0.gguf", "int8.safetensors"]
    got, meta = read_all(out)
    assert meta["h3quant.source"] == f.name  # the GGUF file itself, not a copy
    # the converted layer encodes the GGUF's own dequantized values (not the original BF16)
    from h3quant.formats.int8.tensors import decode_int8

    name = "blocks.0.mlp.fc1"
    with GgufFile(f) as g:
        src = torch.from_numpy(g.read(name + ".weight"))
    dec = decode_int8(got[name + ".weight"], got[name + ".weight_scale"], convrot=True)
    assert (dec - src).norm() / src.norm() < 0.02
    r = CliRunner().invoke(main, ["convert", str(f), str(f)])
    assert r.exit_code == 2 and f.read_bytes()[:4] == b"GGUF"


def _writes(tmp_path, monkeypatch):
    """Every path opened for writing while ``on[0]`` is true (an audit hook: it sees the
    opens of Python, numpy's memmap and the container's own writers), with TMPDIR moved to a
    folder of its own."""
    import os
    import sys
    import tempfile

    tmp = tmp_path / "TMPDIR"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    written: list[str] = []
    on = [False]

    def hook(event, args):
        if event != "open" or not on[0] or isinstance(args[0], int):
            return
        path, mode, flags = args
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            written.append(os.fsdecode(path))

    sys.addaudithook(hook)  # stays installed; silent once ``on[0]`` is false
    return tmp, written, on


def _package_values(path):
    """Every tensor of a GGUF file, dequantized here by the gguf package itself, under the
    names ComfyUI gives them (``model.diffusion_model.`` stripped), in their torch shapes."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        name = t.name.removeprefix("model.diffusion_model.")
        shape = tuple(int(v) for v in reversed(t.shape))
        out[name] = torch.from_numpy(
            gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).copy())
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_convert_to_bf16_writes_the_dequantized_layers_as_bf16(h3, tmp_path, qtype):
    """The GGUF's quantized weights come out BF16 (the gguf package's dequantize, rounded once
    to bf16); its F32 tensors stay F32, value for value."""
    f = tmp_path / f"h3-{qtype}.gguf"
    write_gguf(h3["tensors"], f, qtype)
    out = tmp_path / "h3.safetensors"
    r = CliRunner().invoke(main, ["convert", str(f), str(out), "--to", "bf16", "-q",
                                  "--no-report"])
    assert r.exit_code == 0, r.output
    got, _ = read_all(out)
    want = _package_values(f)
    quantized = {t.name.removeprefix("model.diffusion_model.") for t in gguf.GGUFReader(str(f)).tensors
                 if t.tensor_type.name == qtype}
    assert len(quantized) == 4 and quantized < set(got)
    for name, w in want.items():
        if name in quantized:
            assert got[name].dtype == torch.bfloat16, name
            assert torch.equal(got[name], w.to(torch.bfloat16)), name
        else:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], w), name


@pytest.mark.parametrize("qtype,prefix", [("Q4_0", "model.diffusion_model."), ("Q4_K", "")])
def test_convert_reads_the_gguf_in_place_no_float_copy(h3, tmp_path, monkeypatch, qtype,
                                                       prefix):
    import os

    src_dir, out_dir = tmp_path / "in", tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    f = src_dir / f"h3-{qtype}.gguf"
    write_gguf(h3["tensors"], f, qtype, prefix=prefix)
    tmp, written, on = _writes(tmp_path, monkeypatch)
    out = out_dir / "h3.safetensors"
    on[0] = True
    try:
        r = CliRunner().invoke(main, ["convert", str(f), str(out), "--to", "bf16", "-q",
                                      "--no-report"])
    finally:
        on[0] = False
    assert r.exit_code == 0, r.output
    assert not any(p.startswith(str(tmp)) for p in written), written  # nothing in TMPDIR
    beside = [p for p in written if p.startswith(str(out_dir))]
    assert not [p for p in written if p not in beside and p != os.devnull], written
    data = [p for p in beside if os.path.basename(p) not in (".lock", "journal.json",
                                                             "committed")]
    # the one data file written beside OUT is OUT's own staged copy
    assert len(data) == 1 and os.path.basename(data[0]).startswith(".h3.safetensors."), beside
    assert sorted(p.name for p in out_dir.iterdir()) == ["h3.safetensors"]
    assert sorted(p.name for p in src_dir.iterdir()) == [f.name] and not list(tmp.iterdir())
    got, meta = read_all(out)
    want = _package_values(f)
    assert sorted(got) == sorted(want)
    for name, w in want.items():  # the package's own values (rounded once where OUT is BF16)
        assert torch.equal(got[name], w.to(got[name].dtype)), name
    # nothing re-encoded (every layer already float): the input's own header key is kept
    assert json.loads(meta["h3quant.gguf_source"])["file"] == f.name


@pytest.mark.slow
def test_compare_runs_a_gguf_without_a_float_copy(h3, tmp_path, monkeypatch):
    import os

    f = tmp_path / "h3-Q8_0.gguf"
    write_gguf(h3["tensors"], f, "Q8_0")
    tmp, written, on = _writes(tmp_path, monkeypatch)
    on[0] = True
    try:
        r = CliRunner().invoke(main, ["compare", str(f), "--reference", str(h3["src"]),
                                      "--frames", "1", "--height", "4", "--width", "4",
                                      "--audio-frames", "4", "--text-tokens", "8",
                                      "--device", "cpu", "--json", "--no-expected"])
    finally:
        on[0] = False
    assert r.exit_code == 0, r.output
    rec = next(x for x in json.loads(r.stdout)["records"] if x["path"] == str(f))
    assert rec["outputs"]["video"]["sqnr_db"] > 20
    # the one file compare writes besides the fresh encode of the reference (--no-expected
    # skips it): the reference's block states, in its own work folder
    assert [os.path.basename(p) for p in written if p != os.devnull] == \
        ["reference_states.f32"], written
    assert not list(tmp.iterdir())


@pytest.mark.slow
def test_calibration_statistics_of_a_gguf_file_convert_it_and_only_it(h3, tmp_path):
    """capture reads a GGUF file in place; its statistics calibrate a convert of that file and
    are refused for another GGUF file (its header differs)."""
    from h3quant.calibration.recorder import write_inputs
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.runtime.model.model import H3Model

    f, other = tmp_path / "h3-Q8_0.gguf", tmp_path / "h3-Q4_0.gguf"
    write_gguf(h3["tensors"], f, "Q8_0")
    write_gguf(h3["tensors"], other, "Q4_0")
    with H3Model.open(f) as m:
        vc, ac, td = m.video_channels, m.audio_channels, m.text_dim
    ins = []
    for s in range(5):  # 5 x 256 rows >= K = 1024 (fc2)
        g = torch.Generator().manual_seed(s)
        p = tmp_path / f"in{s}.safetensors"
        write_inputs(p, torch.randn(1, vc, 2, 16, 16, generator=g),
                     torch.randn(1, ac, 2, 32, generator=g), torch.randn(1, 64, td, generator=g),
                     0.5, {"seed": str(s)})
        ins.append(p)
    stats = tmp_path / "q8.stats"
    capture_statistics(f, ins, stats, predict=False)
    out = tmp_path / "int8.safetensors"
    r = CliRunner().invoke(main, ["convert", str(f), str(out), "--to", "int8-convrot",
                                  "--calibration", str(stats), "--no-report", "-q"])
    assert r.exit_code == 0, r.output
    plain = tmp_path / "plain.safetensors"
    r = CliRunner().invoke(main, ["convert", str(f), str(plain), "--to", "int8-convrot",
                                  "--no-report", "-q"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() != plain.read_bytes()  # the statistics chose other codes
    r = CliRunner().invoke(main, ["convert", str(other), str(tmp_path / "x.safetensors"),
                                  "--to", "int8-convrot", "--calibration", str(stats), "-q"])
    assert r.exit_code == 2, r.output
    assert "another checkpoint" in r.output or "measured on" in r.output, r.output


def test_a_gguf_changed_while_read_is_refused_as_a_safetensors_input_is(h3, tmp_path):
    """The same C109 rules as a safetensors input: a size change, a rewrite in place and a
    replaced path are each told apart, and ``convert`` then writes nothing."""
    import os
    import shutil

    from h3quant.sources.gguf_view import GgufView

    f = tmp_path / "h3.gguf"
    write_gguf(h3["tensors"], f, "Q8_0")

    def touch(path):
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def grow(path):
        with open(path, "ab") as fh:
            fh.write(b"\0" * 64)

    def replace(path):
        shutil.copy2(path, tmp_path / "copy.gguf")
        os.replace(tmp_path / "copy.gguf", path)

    for change, message in ((touch, "modified while being read"),
                            (grow, r"changed size while being read \(\d+ -> \d+ bytes\)"),
                            (replace, "replaced or removed while being read")):
        with GgufView(f) as view:
            view.check_unchanged()
            change(f)
            with pytest.raises(ContainerError, match=message) as err:
                view.check_unchanged()
            assert err.value.code == "C109"
    write_gguf(h3["tensors"], f, "Q8_0")
    from h3quant.pipelines.convert import stream

    real = stream.run_plan

    def touch_then_run(plan, ckpt, out, **kw):
        report = real(plan, ckpt, out, **kw)
        touch(f)
        return report

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("h3quant.pipelines.convert.run_plan", touch_then_run)
        r = CliRunner().invoke(main, ["convert", str(f), str(tmp_path / "o.safetensors"),
                                      "--to", "bf16", "-q", "--no-report"])
    assert r.exit_code != 0 and "modified while being read" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3.gguf"]
