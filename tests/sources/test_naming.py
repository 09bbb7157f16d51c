"""Official, diffusers and fp8 inputs of ``convert``: re-laid out as ComfyUI's single file.

The official and diffusers files are built HERE from a ComfyUI file with loops over heads and
rows written for this test (not the product's table), so the expected ComfyUI rows are known
independently of the converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from h3quant.cli import main as cli_main
from h3quant.h3.naming import detect, plan_mapping
from h3quant.pipelines.convert import ConvertOptions, convert, plan_convert
from h3quant.synth import synth_checkpoint

HEAD_DIM = 128  # tiny preset: 4 heads of 128 over hidden 512, ffn 1024


@pytest.fixture(scope="module")
def comfy(tmp_path_factory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("comfy")
    synth_checkpoint(d / "s.safetensors", preset="tiny", blocks=1, seed=3, workers=1)
    return load_file(d / "s.safetensors")


def _official(c: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI [q_all; k_all; v_all] -> the official per-head [q_h; k_h; v_h] rows."""
    out = dict(c)
    for name, w in c.items():
        if not name.endswith("attn.qkv_proj.weight"):
            continue
        width = w.shape[0] // 3
        rows = []
        for h in range(width // HEAD_DIM):
            for part in range(3):
                start = part * width + h * HEAD_DIM
                rows.extend(w[r] for r in range(start, start + HEAD_DIM))
        out[name] = torch.stack(rows).contiguous()
    return out


_TO_DIFFUSERS = [  # ComfyUI -> diffusers prefixes and infixes, written for this test
    ("video_patch_proj.", "proj_in."), ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."), ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.norm.", "norm_out.norm."), ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."), ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("blocks.", "transformer_blocks."),
]
_INFIX = [(".attn.out_proj.", ".attn.to_out.0."), (".attn.q_norm.", ".attn.norm_q."),
          (".attn.k_norm.", ".attn.norm_k."), (".mlp.fc2.", ".ff.net.2.")]


def _diffusers(c: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in c.items():
        new = name
        for a, b in _TO_DIFFUSERS:
            if new.startswith(a):
                new = b + new[len(a):]
                break
        for a, b in _INFIX:
            new = new.replace(a, b)
        if new.endswith(".attn.qkv_proj.weight"):
            stem = new[: -len(".attn.qkv_proj.weight")]
            width = w.shape[0] // 3
            for i, p in enumerate("qkv"):
                out[f"{stem}.attn.to_{p}.weight"] = w[i * width:(i + 1) * width].clone()
            continue
        if new.endswith(".mlp.fc1.weight"):  # ComfyUI [gate; value] -> diffusers [value; gate]
            f = w.shape[0] // 2
            out[new.replace(".mlp.fc1.", ".ff.net.0.proj.")] = torch.cat([w[f:], w[:f]]).clone()
            continue
        out[new] = w
    return out


def _shards(tensors: dict[str, torch.Tensor], d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (d / "config.json").write_text("{}")  # the official release ships one
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": weight_map}))
    return d


def _bits_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].view(torch.uint8) if a[n].numel() else a[n],
                           b[n].view(torch.uint8) if b[n].numel() else b[n]), n


def _opts(**kw) -> ConvertOptions:
    return ConvertOptions(workers=1, report=False, **kw)


def test_handmade_rows_land_in_comfy_order(tmp_path):
    """A hand-made block whose q/k/v and gate/value rows carry their role in their values."""
    heads, d, k = 2, 4, 8
    tag = {"q": 1.0, "k": 2.0, "v": 3.0}
    # official: per head h, q_h, k_h, v_h; row value = 16*role + 4*head + row (exact in bf16)
    off_rows = [[16 * tag[p] + 4 * h + r] * k for h in range(heads) for p in "qkv"
                for r in range(d)]
    src = {
        "blocks.0.attn.qkv_proj.weight": torch.tensor(off_rows, dtype=torch.bfloat16),
        "blocks.0.attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
    }
    m = plan_mapping({n: ("BF16", tuple(t.shape)) for n, t in src.items()}, "official")
    save_file(src, tmp_path / "o.safetensors")
    out = tmp_path / "c.safetensors"
    convert(tmp_path / "o.safetensors", out, _opts(target="bf16", naming="official"))
    got = load_file(out)["blocks.0.attn.qkv_proj.weight"][:, 0].tolist()
    want = [16 * tag[p] + 4 * h + r for p in "qkv" for h in range(heads) for r in range(d)]
    assert got == want
    assert any(t.op == "deinterleave-qkv" for t in m.targets)
    # diffusers: ff.net.0.proj rows [value 0..3; gate 0..3] -> ComfyUI [gate; value]
    value = [[10.0 + r] * k for r in range(4)]
    gate = [[20.0 + r] * k for r in range(4)]
    dsrc = {"transformer_blocks.0.ff.net.0.proj.weight":
            torch.tensor(value + gate, dtype=torch.bfloat16)}
    for p in "qkv":
        dsrc[f"transformer_blocks.0.attn.to_{p}.weight"] = torch.full((4, k), tag[p],
                                                                     dtype=torch.bfloat16)
    save_file(dsrc, tmp_path / "d.safetensors")
    convert(tmp_path / "d.safetensors", tmp_path / "dc.safetensors", _opts(target="bf16"))
    got = load_file(tmp_path / "dc.safetensors")
    assert got["blocks.0.mlp.fc1.weight"][:, 0].tolist() == [20, 21, 22, 23, 10, 11, 12, 13]
    assert got["blocks.0.attn.qkv_proj.weight"][:, 0].tolist() == [1] * 4 + [2] * 4 + [3] * 4


@pytest.mark.parametrize("kind", ["official", "diffusers"])
def test_bf16_relayout_is_bit_exact(comfy, tmp_path, kind):
    src = _official(comfy) if kind == "official" else _diffusers(comfy)
    d = _shards(src, tmp_path / "in")
    tensors = load_file(d / "model-00001-of-00002.safetensors")
    tensors.update(load_file(d / "model-00002-of-00002.safetensors"))
    assert detect({n: (str(t.dtype), tuple(t.shape)) for n, t in tensors.items()},
                  sorted(p.name for p in d.glob("*.safetensors")), True).naming == kind
    out = tmp_path / "out.safetensors"
    convert(d, out, _opts(target="bf16"))
    assert out.is_file()  # ComfyUI's single file, not a directory of shards
    _bits_equal(load_file(out), comfy)
    assert not list(tmp_path.glob(".*staging*"))  # the staging directory is gone


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["official", "diffusers"])
def test_int8_convrot_equals_the_comfy_source_conversion(comfy, tmp_path, kind):
    src = _official(comfy) if kind == "official" else _diffusers(comfy)
    d = _shards(src, tmp_path / "h3")
    (tmp_path / "ref").mkdir()
    ref_in = tmp_path / "ref" / "h3"  # the provenance records the input's name: the directory "h3"
    save_file(comfy, ref_in)
    convert(ref_in, tmp_path / "ref.safetensors", _opts())
    convert(d, tmp_path / "got.safetensors", _opts())
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def _fp8(comfy, dtype, per_row: bool, name_scale="scale_weight"):
    out = dict(comfy)
    expected = {}
    for name, w in comfy.items():
        if not (name.startswith("blocks.") and name.endswith("_proj.weight") or ".mlp.fc" in name):
            continue
        w32 = w.float()
        amax = w32.abs().amax(dim=1, keepdim=True) if per_row else w32.abs().amax().reshape(1)
        scale = (amax / 240.0).clamp(min=1e-8)
        codes = (w32 / scale).to(dtype)
        stem = name[: -len(".weight")]
        out[name] = codes
        out[f"{stem}.{name_scale}"] = scale.float()
        expected[name] = codes.float() * scale  # what the loader multiplies out, in fp32
    return out, expected


@pytest.mark.parametrize("dtype,per_row,scale_name", [
    (torch.float8_e4m3fn, True, "scale_weight"), (torch.float8_e5m2, False, "weight_scale")])
@pytest.mark.slow
def test_fp8_decodes_exactly(comfy, tmp_path, dtype, per_row, scale_name):
    src, expected = _fp8(comfy, dtype, per_row, scale_name)
    save_file(src, tmp_path / "f8.safetensors")
    convert(tmp_path / "f8.safetensors", tmp_path / "bf16.safetensors", _opts(target="bf16"))
    got = load_file(tmp_path / "bf16.safetensors")
    for name, want in expected.items():
        assert torch.equal(got[name], want.to(torch.bfloat16)), name
    assert not any(n.endswith(scale_name) for n in got)
    # int8-convrot from fp8 equals int8-convrot from the exact fp32 decode; the linears it
    # copies rather than re-encodes are written BF16 (rounded once) with a per-row scale, and
    # kept in float8 (codes and scale as stored) with a per-tensor one; never widened to F32
    from h3quant.h3.topology import is_h3_block_linear

    ref = dict(comfy)
    ref.update({n: w if is_h3_block_linear(n[: -len(".weight")]) else w.to(torch.bfloat16)
                for n, w in expected.items()})
    (tmp_path / "r").mkdir()
    save_file(ref, tmp_path / "r" / "f8.safetensors")
    convert(tmp_path / "r" / "f8.safetensors", tmp_path / "ref8.safetensors", _opts())
    convert(tmp_path / "f8.safetensors", tmp_path / "got8.safetensors", _opts())
    if per_row:
        assert (tmp_path / "got8.safetensors").read_bytes() == \
            (tmp_path / "ref8.safetensors").read_bytes()
        return
    got, want = load_file(tmp_path / "got8.safetensors"), load_file(tmp_path / "ref8.safetensors")
    kept = {n[: -len(".weight")] for n in expected if not is_h3_block_linear(n[: -len(".weight")])}
    assert kept
    for stem in kept:
        assert torch.equal(got[f"{stem}.weight"].view(torch.uint8),
                           src[f"{stem}.weight"].view(torch.uint8)), stem
        assert torch.equal(got[f"{stem}.weight_scale"], src[f"{stem}.{scale_name}"].reshape(()))
    assert set(got) - set(want) == {f"{s}.{x}" for s in kept for x in ("weight_scale", "comfy_quant")}
    for name in want:
        if name[: -len(".weight")] not in kept:
            assert torch.equal(got[name], want[name]), name


def test_dry_run_shows_the_map_and_writes_nothing(comfy, tmp_path):
    d = _shards(_diffusers(comfy), tmp_path / "in")
    plan = plan_convert(d, tmp_path / "o.safetensors", _opts()).to_dict()
    assert plan["naming"]["naming"] == "diffusers"
    fused = [t for t in plan["naming"]["targets"] if t["op"] == "fuse-qkv"]
    assert {tuple(t["sources"]) for t in fused} >= {tuple(
        f"transformer_blocks.0.attn.to_{p}.weight" for p in "qkv")}
    res = CliRunner().invoke(cli_main, ["convert", str(d), str(tmp_path / "o.safetensors"),
                                        "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "transformer_blocks.0.attn.to_q.weight + transformer_blocks.0.attn.to_k.weight" \
        in res.output
    assert not (tmp_path / "o.safetensors").exists()
    assert not list(tmp_path.glob(".*staging*"))


def _cli_fails(tensors, tmp_path, code):
    save_file(tensors, tmp_path / "bad.safetensors")
    before = (tmp_path / "bad.safetensors").read_bytes()
    res = CliRunner().invoke(cli_main, ["convert", str(tmp_path / "bad.safetensors"),
                                        str(tmp_path / "o.safetensors"), "--to", "bf16"])
    assert res.exit_code != 0
    assert code in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()
    assert (tmp_path / "bad.safetensors").read_bytes() == before
    assert not list(tmp_path.glob(".*staging*"))


def test_errors(comfy, tmp_path):
    dif = _diffusers(comfy)
    no_k = {n: t for n, t in dif.items() if n != "transformer_blocks.0.attn.to_k.weight"}
    _cli_fails(no_k, tmp_path, "N302")
    bad_v = dict(dif)
    bad_v["transformer_blocks.0.attn.to_v.weight"] = bad_v[
        "transformer_blocks.0.attn.to_v.weight"][:-8].clone()
    _cli_fails(bad_v, tmp_path, "N303")
    half = dict(dif)
    half["blocks.0.mlp.fc2.weight"] = half.pop("transformer_blocks.0.ff.net.2.weight")
    _cli_fails(half, tmp_path, "N301")
    f8, _ = _fp8(comfy, torch.float8_e4m3fn, True)
    neg = dict(f8)
    neg["blocks.0.mlp.fc2.scale_weight"] = -neg["blocks.0.mlp.fc2.scale_weight"]
    _cli_fails(neg, tmp_path, "N305")
    shape = dict(f8)
    shape["blocks.0.mlp.fc2.scale_weight"] = torch.ones(3, dtype=torch.float32)
    _cli_fails(shape, tmp_path, "N305")


def _cli(*args):
    return CliRunner().invoke(cli_main, [str(a) for a in args])


@pytest.mark.parametrize("kind", ["comfy", "official", "diffusers", "fp8"])
def test_inspect_and_validate_know_each_naming(comfy, tmp_path, kind):
    if kind == "fp8":
        src = tmp_path / "f8.safetensors"
        save_file(_fp8(comfy, torch.float8_e4m3fn, True)[0], src)
    elif kind == "comfy":
        src = tmp_path / "c.safetensors"
        save_file(comfy, src)
    else:
        src = _shards(_official(comfy) if kind == "official" else _diffusers(comfy),
                      tmp_path / "in")
    res = _cli("inspect", src, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["naming"]["naming"] == ("comfy" if kind == "fp8" else kind)
    assert doc["naming"]["fp8_scaled"] == (8 if kind == "fp8" else 0)  # block 0: 4, refiner fc1/fc2: 4
    assert "naming" in _cli("inspect", src).output
    res = _cli("validate", src, "--deep", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["checked"]["topology"] is not None


@pytest.mark.slow
def test_validate_gives_naming_codes(comfy, tmp_path):
    dif = _diffusers(comfy)
    no_k = {n: t for n, t in dif.items() if n != "transformer_blocks.0.attn.to_k.weight"}
    save_file(no_k, tmp_path / "nok.safetensors")
    res = _cli("validate", tmp_path / "nok.safetensors", "--json")
    assert res.exit_code != 0 and "N302" in res.output
    f8, _ = _fp8(comfy, torch.float8_e4m3fn, True)
    f8["blocks.0.mlp.fc1.scale_weight"][3] = float("nan")
    save_file(f8, tmp_path / "nan.safetensors")
    assert _cli("validate", tmp_path / "nan.safetensors").exit_code == 0  # values: --deep only
    res = _cli("validate", tmp_path / "nan.safetensors", "--deep", "--json")
    assert res.exit_code != 0 and "N305" in res.output


def test_block_scaled_fp8_layer_is_not_decoded_as_scaled_fp8(comfy, tmp_path):
    """An fp8 weight with a U8 (E8M0) block scale and its own marker (comfy-kitchen's MXFP8) is
    another format: convert decodes it through the mxfp8 codec (scale byte 127 = 1.0) instead of
    multiplying the block scale in as a scaled-fp8 scale."""
    from h3quant.formats.markers import MARKER_SUFFIX, marker_tensor

    t = dict(comfy)
    w = t["blocks.0.mlp.fc2.weight"]
    t["blocks.0.mlp.fc2.weight"] = w.float().to(torch.float8_e4m3fn)
    t["blocks.0.mlp.fc2.weight_scale"] = torch.full((w.shape[0], w.shape[1] // 32), 127,
                                                    dtype=torch.uint8)
    t["blocks.0.mlp.fc2" + MARKER_SUFFIX] = marker_tensor({"format": "mxfp8"})
    src = tmp_path / "mx.safetensors"
    save_file(t, src)
    r = _cli("convert", src, tmp_path / "o.safetensors", "--to", "bf16")
    assert r.exit_code == 0, r.output
    assert "N305" not in r.output
    out = load_file(tmp_path / "o.safetensors")
    assert torch.equal(out["blocks.0.mlp.fc2.weight"].float(),
                       t["blocks.0.mlp.fc2.weight"].float())


@pytest.mark.slow
def test_each_computed_tensor_is_built_once(comfy, tmp_path, monkeypatch):
    """fp8 input (every DiT and refiner linear decoded): copies and the layer being encoded do
    not evict each other, so every tensor is computed once, not once per chunk."""
    from collections import Counter

    from h3quant.sources import comfy_view as adopt

    src = tmp_path / "f8.safetensors"
    assert _cli("synth", src, "--dtype", "fp8", "--seed", "3").exit_code == 0
    calls: Counter = Counter()
    real = adopt.build_target

    def counting(ckpt, t):
        calls[t.name] += 1
        return real(ckpt, t)
    monkeypatch.setattr(adopt, "build_target", counting)
    monkeypatch.setattr("h3quant.pipelines.convert.compute.CHUNK_ELEMS", 1 << 14)  # many chunks
    monkeypatch.setattr(adopt, "CACHE_EXTRA", 64 << 10)  # weights count as big, biases not
    convert(src, tmp_path / "o.safetensors", ConvertOptions(workers=2, report=False))
    assert calls and max(calls.values()) == 1, calls.most_common(3)
