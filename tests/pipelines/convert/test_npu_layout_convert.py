"""The NPU layout int8_tensorwise_kn (FORMATS.md 9): the chunked transposer, convert --layout npu,
pure relayouts both ways (byte-identical round trip), W4A8 through its int8 grid."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3quant.errors import ConvertError, FormatError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.int8_kn.tensors import kn_marker, nz_eligible, tp_degree_for
from h3quant.formats.transpose import RowTransposer
from h3quant.formats.markers import parse_header_metadata
from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
from h3quant.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[3]
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


# ----------------------------------------------------------------------------- transposer
def _collect(rows, cols):
    out = bytearray(rows * cols)
    calls = []

    def write(offset, data):
        data = bytes(data)
        calls.append((offset, len(data)))
        out[offset:offset + len(data)] = data

    return out, calls, write


@pytest.mark.parametrize("rows,cols,buf,pieces", [(37, 23, 23 * 5, [1, 4, 10, 3, 19]),
                                                  (16, 8, 1 << 20, [16]),
                                                  (9, 31, 31, [2, 7])])
def test_row_transposer_equals_transpose_for_any_chunking(rows, cols, buf, pieces):
    g = torch.Generator().manual_seed(rows)
    a = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    out, calls, write = _collect(rows, cols)
    t = RowTransposer(rows, cols, write, buffer_bytes=buf)
    r = 0
    for p in pieces:
        t.add(a[r:r + p])
        r += p
    t.finish()
    got = torch.frombuffer(out, dtype=torch.int8).reshape(cols, rows)
    assert torch.equal(got, a.t())
    assert t.slab_rows == max(1, min(rows, buf // cols))
    if t.slab_rows == rows:
        assert calls == [(0, rows * cols)]  # one slab: one contiguous write
    else:  # never more than one slab of rows per piece
        assert max(n for _, n in calls) <= t.slab_rows


def test_row_transposer_refuses_extra_or_missing_rows():
    _, _, write = _collect(4, 3)
    t = RowTransposer(4, 3, write)
    with pytest.raises(FormatError, match="rows given"):
        t.add(torch.zeros(5, 3, dtype=torch.int8))
    with pytest.raises(FormatError, match=r"\[\*, 3\]"):
        t.add(torch.zeros(2, 4, dtype=torch.int8))
    t.add(torch.zeros(3, 3, dtype=torch.int8))
    with pytest.raises(FormatError, match="3 of 4 rows"):
        t.finish()


def test_nz_and_tensor_parallel_rules():
    assert nz_eligible(32, 16) and nz_eligible(21504, 5376)
    assert not nz_eligible(48, 16) and not nz_eligible(32, 8)
    assert tp_degree_for(65535) == 1
    assert tp_degree_for(86016) == 2  # 2 x 43008
    assert tp_degree_for(65537) is None  # a prime: no equal split fits
    assert kn_marker() == {"format": "int8_tensorwise_kn", "convrot": True,
                           "convrot_groupsize": 256}


# ----------------------------------------------------------------------------- convert
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kn")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=3)
    canon = d / "canon.safetensors"
    kn = d / "kn.safetensors"
    convert(src, canon, ConvertOptions(target="int8-convrot"))
    convert(src, kn, ConvertOptions(target="int8-convrot", layout="npu"))
    return {"src": src, "canon": canon, "kn": kn, "dir": d}


def _layers(path):
    with Checkpoint(path) as ck:
        return ({n: ck.read(n).clone() for n in ck.tensors}, dict(ck.metadata),
                {n: (i.dtype, tuple(i.shape)) for n, i in ck.tensors.items()})


def test_layout_npu_writes_the_transposed_codes_and_a_1d_scale(files):
    canon, _, _ = _layers(files["canon"])
    kn, meta, header = _layers(files["kn"])
    names = [f"blocks.{i}.{s}" for i in range(2) for s in LINEARS]
    for name in names:
        q, s = canon[name + ".weight"], canon[name + ".weight_scale"]
        n, k = q.shape
        assert header[name + ".weight"] == ("I8", (k, n))
        assert header[name + ".weight_scale"] == ("F32", (n,))
        assert kn[name + ".weight"].is_contiguous()
        assert torch.equal(kn[name + ".weight"], q.t())
        assert torch.equal(kn[name + ".weight_scale"], s.reshape(-1))
        marker = bytes(kn[name + ".comfy_quant"].numpy())
        assert marker == b'{"format": "int8_tensorwise_kn", "convrot": true, "convrot_groupsize": 256}'
    assert parse_header_metadata(meta) == dict.fromkeys(names, kn_marker())
    assert json.loads(meta["h3quant.options"])["layout"] == "npu"
    # every other tensor is the canonical file's, byte for byte
    for name, t in canon.items():
        if not any(name.startswith(x + ".") for x in names):
            assert torch.equal(kn[name], t), name


def test_relayout_round_trip_is_byte_identical(files, tmp_path):
    to_kn = tmp_path / "c2kn.safetensors"
    back = tmp_path / "back.safetensors"
    plan = plan_convert(files["canon"], to_kn, ConvertOptions(layout="npu"))
    assert all(lp.via == "relayout" for lp in plan.layers if lp.action == "convert")
    report = convert(files["canon"], to_kn, ConvertOptions(layout="npu"))
    assert report.counts["convert"] == 8 and report.summary == {"layers": 0}
    assert all("pure relayout" in lay["notes"][0] for lay in report.layers)
    # canonical -> kn equals a direct bf16 -> kn conversion (same codes, same provenance) ...
    assert filecmp.cmp(to_kn, files["kn"], shallow=False)
    # ... and kn -> canonical gives back exactly the canonical bytes
    convert(to_kn, back, ConvertOptions())
    assert filecmp.cmp(back, files["canon"], shallow=False)
    direct = tmp_path / "kn2c.safetensors"
    convert(files["kn"], direct, ConvertOptions(layout="canonical"))
    assert subprocess.run(["cmp", str(direct), str(files["canon"])], check=False).returncode == 0


@pytest.mark.slow
def test_relayout_in_small_slabs_gives_the_same_bytes(files, tmp_path, monkeypatch):
    """Bounded memory: a transpose slab much smaller than a layer changes nothing."""
    from h3quant.pipelines.convert import relayout

    seen = []
    real = relayout.transpose_stream

    def spy(*a, **k):
        k["buffer_bytes"] = 4096
        seen.append(a[1:3])
        return real(*a, **k)

    monkeypatch.setattr(relayout, "transpose_stream", spy)
    out = tmp_path / "small.safetensors"
    convert(files["canon"], out, ConvertOptions(layout="npu"))
    assert len(seen) == 8 and all(r * c > 4096 for r, c in seen)
    assert filecmp.cmp(out, files["kn"], shallow=False)
    back = tmp_path / "small_back.safetensors"
    convert(out, back, ConvertOptions())
    assert filecmp.cmp(back, files["canon"], shallow=False)


def test_kn_source_decodes_like_the_canonical_one(files, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    convert(files["kn"], a, ConvertOptions(target="bf16"))
    convert(files["canon"], b, ConvertOptions(target="bf16"))
    ta, _, _ = _layers(a)
    tb, _, _ = _layers(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


@pytest.mark.slow
def test_w4a8_to_kn_takes_the_decoded_int8_grid(files, tmp_path):
    from h3quant.formats.w4a8.tensors import decode_w4a8_int8

    w4 = tmp_path / "w4.safetensors"
    convert(files["src"], w4, ConvertOptions(target="w4a8", include=("blocks\\.0\\.attn",)))
    out = tmp_path / "w4kn.safetensors"
    report = convert(w4, out, ConvertOptions(layout="npu", include=("blocks\\.0\\.attn",)))
    notes = {lay["name"]: lay.get("notes", []) for lay in report.layers}
    assert "int8 grid" in notes["blocks.0.attn.qkv_proj"][0]
    src, _, _ = _layers(w4)
    got, _, header = _layers(out)
    for name in ("blocks.0.attn.qkv_proj", "blocks.0.attn.out_proj"):
        q = decode_w4a8_int8(src[name + ".weight"], src[name + ".weight_s_rel"],
                             group_size=16, codebook=src[name + ".weight_codebook"])
        assert torch.equal(got[name + ".weight"], q.t())
        assert torch.equal(got[name + ".weight_scale"], src[name + ".weight_s_channel"].reshape(-1))
        assert header[name + ".weight_scale"] == ("F32", (q.shape[0],))


def test_layout_npu_only_for_int8_targets(files, tmp_path):
    with pytest.raises(ConvertError, match="--layout npu is not available for --to w4a8"):
        ConvertOptions(target="w4a8", layout="npu")
    with pytest.raises(ConvertError, match="--layout must be one of"):
        ConvertOptions(layout="nz")
    res = subprocess.run([sys.executable, "-m", "h3quant", "convert", str(files["src"]),
                          str(tmp_path / "x.safetensors"), "--to", "bf16", "--layout", "npu"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--layout npu is not available" in res.stderr
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.slow
def test_cli_layout_npu_and_dry_run(files, tmp_path):
    out = tmp_path / "cli_kn.safetensors"
    res = subprocess.run([sys.executable, "-m", "h3quant", "convert", str(files["canon"]),
                          str(out), "--layout", "npu", "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr
    assert "layout npu" in res.stdout and "pure relayout" in res.stdout
    assert not out.exists()
    res = subprocess.run([sys.executable, "-m", "h3quant", "convert", str(files["canon"]),
                          str(out), "--layout", "npu", "-q"], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr
    assert filecmp.cmp(out, files["kn"], shallow=False)
    # the kn file is already what --layout npu writes: kept, re-emitted unchanged
    again = tmp_path / "again.safetensors"
    report = convert(out, again, ConvertOptions(layout="npu"))
    assert report.counts["keep"] == 8 and filecmp.cmp(again, out, shallow=False)


@pytest.mark.slow
def test_int8_from_the_w4a8_grid_passes_verify_data_checks(files, tmp_path):
    """Its rows peak in [96, 127] like W4A8's (not at 127 like freshly encoded int8): verify's
    reference-free checks take that, in both layouts; scales off by 2 still fail."""
    from h3quant.formats.container.writer import save_tensors
    from h3quant.pipelines.verify.blocks import verify_checkpoint

    w4 = tmp_path / "w4.safetensors"
    convert(files["src"], w4, ConvertOptions(target="w4a8", include=("blocks\\.0\\.attn\\.out",)))
    for layout in ("canonical", "npu"):
        out = tmp_path / f"grid_{layout}.safetensors"
        convert(w4, out, ConvertOptions(layout=layout, include=("blocks\\.0\\.attn\\.out",)))
        r = verify_checkpoint(out, device="cpu", tokens=8, blocks=[0])
        rows = [c for c in r.data if c.check == "row-range"]
        assert rows and all(c.passed for c in rows), r.failures
    t, meta, _ = _layers(tmp_path / "grid_canonical.safetensors")
    t["blocks.0.attn.out_proj.weight_scale"] = t["blocks.0.attn.out_proj.weight_scale"] * 2
    t["blocks.0.attn.out_proj.weight"] = (t["blocks.0.attn.out_proj.weight"].to(torch.int16)
                                          // 2).to(torch.int8)  # codes halved to match
    bad = tmp_path / "halved.safetensors"
    save_tensors(bad, t, meta)
    r = verify_checkpoint(bad, device="cpu", tokens=8, blocks=[0])
    rows = {c.name: c for c in r.data if c.check == "row-range"}
    assert not rows["blocks.0.attn.out_proj"].passed


def test_a_tensorwise_scale_is_repeated_per_column_for_kn(tmp_path):
    """A true tensorwise int8 layer (one scale []) relays out to kn with that scale on all N
    columns: same codes, same values, no requantization."""
    from helpers.forge import int8_layer, save

    t = int8_layer("lin", n=48, k=64, scale_shape=(), marker={"format": "int8_tensorwise"})
    src = save(tmp_path / "tw.safetensors", t)
    out = tmp_path / "tw_kn.safetensors"
    report = convert(src, out, ConvertOptions(target="int8", layout="npu"))
    assert report.layers[0]["action"] == "convert"
    got, meta, header = _layers(out)
    assert header["lin.weight"] == ("I8", (64, 48)) and header["lin.weight_scale"] == ("F32", (48,))
    assert torch.equal(got["lin.weight"], t["lin.weight"].t())
    assert torch.equal(got["lin.weight_scale"], t["lin.weight_scale"].expand(48))
    assert parse_header_metadata(meta)["lin"] == {"format": "int8_tensorwise_kn"}
