"""verify judges int8 layers converted from W4A8 by W4A8's limits, and only those.

Files: a synthetic BF16 checkpoint -> W4A8 -> int8 in each layout (convert's CLI). The checks:
they pass against the BF16 source with the reason stated; the same check fails when one layer's
scales are multiplied by 4 or its rows permuted (corrupted here with safetensors directly); a
plain int8 file made from BF16 keeps int8's limits; the grid test is checked against a W4A8 grid
decoded and built here, independently of the product's decoder and tables.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3quant.cli import main
from h3quant.formats.w4a8.grid import grid_table

pytestmark = pytest.mark.slow  # whole-model / verify runs on module-wide files: the slow subset

LAYER = "blocks.0.attn.out_proj"
KEY = "h3quant.from_w4a8"


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


def _meta(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def rewrite(src, dst, edit=None, *, drop_key=False):
    """Copy ``src`` to ``dst`` with safetensors, after ``edit(tensors, metadata)``; ``drop_key`` removes the
    header's from-W4A8 record (a file made by another tool)."""
    t, meta = load_file(str(src)), _meta(src)
    if edit is not None:
        edit(t, meta)
    if drop_key:
        meta.pop(KEY, None)
    save_file(t, str(dst), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prov")
    out = {"bf16": d / "bf16.safetensors", "w4a8": d / "w4a8.safetensors"}
    assert cli("synth", out["bf16"], "--blocks", "1", "-q").exit_code == 0
    assert cli("convert", out["bf16"], out["w4a8"], "--to", "w4a8", "-q").exit_code == 0
    for name, opts in {"int8-convrot": ["--to", "int8-convrot"], "int8": ["--to", "int8"],
                       "kn": ["--to", "int8-convrot", "--layout", "npu"]}.items():
        out[name] = d / f"{name}.safetensors"
        res = cli("convert", out["w4a8"], out[name], *opts, "-q")
        assert res.exit_code == 0, res.output
    out["direct"] = d / "direct.safetensors"
    assert cli("convert", out["bf16"], out["direct"], "--to", "int8-convrot", "-q").exit_code == 0
    out["dir"] = d
    return out


def verify(path, ref, *extra):
    """verify with the fixed per-format limits, which the provenance rule chooses between (the
    default, a fresh encode of the reference, is tested in test_verdicts.py)."""
    res = cli("verify", path, "--reference", ref, "--device", "cpu", "--json", "--no-expected",
              *extra)
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def per_layer(path, ref):
    return verify(path, ref, "--tokens", "16")


def model(path, ref):
    return verify(path, ref, "--model", "--frames", "1", "--height", "8", "--width", "8",
                  "--audio-frames", "8", "--text-tokens", "8")


# --------------------------------------------------------------------- converted from W4A8


@pytest.mark.parametrize("layout", ["int8-convrot", "int8", "kn"])
def test_int8_from_w4a8_passes_against_bf16_with_the_header_reason(files, layout):
    assert KEY in _meta(files[layout])
    res = per_layer(files[layout], files["bf16"])
    assert res["passed"], res["failures"]
    assert {c["limit"] for c in res["layers"]} == {0.12}
    assert {b["limit_db"] for b in res["block_checks"]} == {8.0}
    assert set(res["provenance"]) == {c["name"] for c in res["layers"]}
    assert {p["reason"] for p in res["provenance"].values()} == {"header says converted from W4A8"}
    assert any("header says converted from W4A8" in n for n in res["notes"])
    # the same file holds the W4A8 error: int8's own limits would fail it
    assert max(c["rel_err"] for c in res["layers"]) > 0.05


@pytest.mark.parametrize("layout", ["int8-convrot", "kn"])
def test_without_the_header_record_the_grid_is_found_in_the_data(files, layout, tmp_path):
    bare = rewrite(files[layout], tmp_path / "bare.safetensors", drop_key=True)
    res = per_layer(bare, files["bf16"])
    assert res["passed"], res["failures"]
    reasons = {p["reason"] for p in res["provenance"].values()}
    assert len(reasons) == 1 and reasons.pop().startswith("rows on a W4A8 grid")
    text = cli("verify", bare, "--reference", files["bf16"], "--device", "cpu", "--tokens", "16",
               "--no-expected")
    assert text.exit_code == 0 and "judged as W4A8" in text.output
    assert "rows on a W4A8 grid" in text.output


def test_plain_int8_from_w4a8_needs_the_header_record(files, tmp_path):
    """Without ConvRot the codes are a re-encoding (no W4A8 grid): only the header tells."""
    bare = rewrite(files["int8"], tmp_path / "bare.safetensors", drop_key=True)
    res = per_layer(bare, files["bf16"])
    assert not res["passed"] and res["provenance"] == {}


@pytest.mark.parametrize("layout", ["int8-convrot", "kn"])
def test_model_mode_passes_at_the_w4a8_limit(files, layout, tmp_path):
    res = model(files[layout], files["bf16"])
    assert res["passed"], res["failures"]
    assert {o["limit_db"] for o in res["outputs"]} == {8.0} and res["provenance"]
    bare = rewrite(files[layout], tmp_path / "bare.safetensors", drop_key=True)
    res = model(bare, files["bf16"])
    assert res["passed"], res["failures"]
    assert next(iter(res["provenance"].values()))["reason"].startswith("rows on a W4A8 grid")


# ------------------------------------------------------------------------------ corruption


def _scales_x4(t, meta):
    t[LAYER + ".weight_scale"] = t[LAYER + ".weight_scale"] * 4


def _permute_rows(t, meta):
    w = t[LAYER + ".weight"]
    g = torch.Generator().manual_seed(1)
    fmt = json.loads(meta["_quantization_metadata"])["layers"][LAYER]["format"]
    if fmt == "int8_tensorwise_kn":  # stored [K, N]: a row of the layer is a column
        t[LAYER + ".weight"] = w[:, torch.randperm(w.shape[1], generator=g)].contiguous()
    else:
        t[LAYER + ".weight"] = w[torch.randperm(w.shape[0], generator=g)].contiguous()


@pytest.mark.parametrize("layout", ["int8-convrot", "int8", "kn"])
@pytest.mark.parametrize("edit", [_scales_x4, _permute_rows], ids=["scales-x4", "rows-permuted"])
@pytest.mark.parametrize("header", [True, False], ids=["header", "bare"])
def test_the_same_check_fails_on_corrupted_files(files, layout, edit, header, tmp_path):
    if layout == "int8" and not header:
        pytest.skip("a bare plain-int8 file is judged by int8's limits (test above)")
    bad = rewrite(files[layout], tmp_path / "bad.safetensors", edit, drop_key=not header)
    res = per_layer(bad, files["bf16"])
    assert not res["passed"]
    assert any(f.startswith(f"layer {LAYER} ") for f in res["failures"]), res["failures"]
    assert res["provenance"][LAYER]["judged_as"] == "asym_w4a8_int8"  # judged as W4A8: fails
    ok = [c for c in res["layers"] if c["name"] != LAYER]
    assert ok and all(c["passed"] for c in ok)


def test_model_mode_fails_on_corrupted_scales(files, tmp_path):
    bad = rewrite(files["int8-convrot"], tmp_path / "bad.safetensors", _scales_x4)
    assert not model(bad, files["bf16"])["passed"]


# ------------------------------------------------------------------ int8 made from floats


def test_plain_int8_from_bf16_keeps_int8_limits(files, tmp_path):
    assert KEY not in _meta(files["direct"])
    res = per_layer(files["direct"], files["bf16"])
    assert res["passed"] and res["provenance"] == {}
    assert {c["limit"] for c in res["layers"]} == {0.05}
    assert {b["limit_db"] for b in res["block_checks"]} == {20.0}
    assert {o["limit_db"] for o in model(files["direct"], files["bf16"])["outputs"]} == {20.0}

    def noisy(t, meta):  # an int8 error between int8's limit and W4A8's one
        w = t[LAYER + ".weight"]
        g = torch.Generator().manual_seed(2)
        noise = torch.randint(-9, 10, w.shape, generator=g, dtype=torch.int16)
        t[LAYER + ".weight"] = (w.to(torch.int16) + noise).clamp(-127, 127).to(torch.int8)

    res = per_layer(rewrite(files["direct"], tmp_path / "noisy.safetensors", noisy), files["bf16"])
    bad = [c for c in res["layers"] if c["name"] == LAYER]
    assert all(0.05 < c["rel_err"] < 0.12 for c in bad), bad
    assert not res["passed"] and res["provenance"] == {}


# -------------------------------------------------- the grid test, against our own construction


def _e4m3(bits: np.ndarray) -> np.ndarray:
    """e4m3fn bit patterns -> float64, decoded here (sign, 4 exponent bits, bias 7, 3 mantissa
    bits; exponent 0 is subnormal)."""
    b = bits.astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where(b & 0x80, -val, val)


def _decode_here(t: dict) -> np.ndarray:
    """A W4A8 layer's int8 grid, decoded from its stored bytes with numpy."""
    packed = t[LAYER + ".weight"].view(torch.uint8).numpy()
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    levels = t[LAYER + ".weight_codebook"].numpy().astype(np.float32)[codes]
    s = _e4m3(t[LAYER + ".weight_s_rel"].view(torch.uint8).numpy()).astype(np.float32)
    v = levels.reshape(codes.shape[0], -1, 16) * s[:, :, None]  # fp32, as the format says
    return np.clip(np.rint(v), -127, 127).reshape(codes.shape).astype(np.int8)


def test_the_int8_files_hold_the_w4a8_grid_decoded_here(files):
    w8 = _decode_here(load_file(str(files["w4a8"])))
    assert np.array_equal(load_file(str(files["int8-convrot"]))[LAYER + ".weight"].numpy(), w8)
    assert np.array_equal(load_file(str(files["kn"]))[LAYER + ".weight"].numpy().T, w8)
    assert grid_table(torch.from_numpy(w8)) is not None


def _built_grid(table: np.ndarray, n: int, k: int, seed: int) -> torch.Tensor:
    """Rows on a W4A8 grid built here: random codes, random positive e4m3 group scales."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(n, k))
    bits = rng.integers(0x30, 0x7F, size=(n, k // 16))  # positive e4m3 scales 0.5 .. 448
    s = _e4m3(bits).astype(np.float32)
    v = table.astype(np.float32)[codes].reshape(n, -1, 16) * s[:, :, None]
    return torch.from_numpy(np.clip(np.rint(v), -127, 127).reshape(n, k).astype(np.int8))


def test_grids_built_here_are_found_and_near_misses_are_not(files):
    uniform = np.arange(-8, 8, dtype=np.float32)  # the format's table without a codebook
    frozen = load_file(str(files["w4a8"]))[LAYER + ".weight_codebook"].numpy()  # as stored
    for table in (uniform, frozen):
        q = _built_grid(table, 64, 512, seed=3)
        assert grid_table(q) is not None
        off = q.clone()  # one code moved off its group's grid
        g = off[5, 32:48].to(torch.int16)
        candidates = [v for v in range(-127, 128) if v not in set(g.tolist())]
        # a value the group's grid lacks for every scale cannot be produced; take the one
        # furthest from the group's values, then check it is off every scale's grid here
        s_all = _e4m3(np.arange(1, 127)).astype(np.float32)
        grids = [set(np.clip(np.rint(table * s), -127, 127).astype(int).tolist()) for s in s_all]
        others = set(g[1:].tolist())
        bad = next(v for v in candidates
                   if not any(others | {v} <= grid for grid in grids))
        off[5, 32] = bad
        assert grid_table(off) is None


def test_random_int8_rows_are_not_mistaken_for_a_w4a8_grid():
    g = torch.Generator().manual_seed(4)
    uniform = torch.randint(-127, 128, (64, 512), generator=g, dtype=torch.int16).to(torch.int8)
    assert grid_table(uniform) is None
    w = torch.randn(64, 512, generator=g)
    gauss = (w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8)
    assert grid_table(gauss) is None


# -------------------------------------------------------------- the header record, by convert


def test_convert_keeps_the_record_through_relayouts_and_drops_it_when_reencoded(files, tmp_path):
    names = json.loads(_meta(files["int8-convrot"])[KEY])
    assert names == sorted(n for n in json.loads(_meta(files["int8-convrot"])
                                                 ["_quantization_metadata"])["layers"])
    kn = tmp_path / "kn.safetensors"
    assert cli("convert", files["int8-convrot"], kn, "--layout", "npu", "-q").exit_code == 0
    assert json.loads(_meta(kn)[KEY]) == names
    back = tmp_path / "back.safetensors"
    assert cli("convert", kn, back, "--layout", "canonical", "-q").exit_code == 0
    assert json.loads(_meta(back)[KEY]) == names
    bf16 = tmp_path / "bf16.safetensors"
    assert cli("convert", files["int8-convrot"], bf16, "--to", "bf16", "-q").exit_code == 0
    assert KEY not in _meta(bf16)
    part = tmp_path / "part.safetensors"  # re-encode block 0 from floats, keep the rest
    assert cli("convert", bf16, part, "--to", "int8-convrot", "-q").exit_code == 0
    assert KEY not in _meta(part)
