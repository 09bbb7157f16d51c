"""``h3quant compare``: the card ranks files right (planted defects below the clean file of the
same format, the per-block drift pointing at the broken block), reads GGUF files (Q8_0 / Q4_0
by the gguf package's quantizers, Q4_K written block by block here), and writes its outputs by
the output rules."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from helpers.gguf_files import write_gguf
from helpers.h3files import quantize_file, read_tensors as read_all

from h3quant.cli import main

pytestmark = pytest.mark.slow  # every test runs whole-model sampling over many files

BLOCKS, BAD = 3, 1  # the defects sit in block 1 of 3
SMALL = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "4",
         "--text-tokens", "8", "--device", "cpu"]


def _in_bad_block(layer: str, role: str) -> bool:
    return layer == f"blocks.{BAD}.{role}"


def _wrong_hadamard_sign(layer, parts, w):
    """Made with a Hadamard whose row 0 of each group has the wrong sign: the rotated weight's
    first column of every 256-group is negated."""
    if _in_bad_block(layer, "mlp.fc1"):
        q = parts["weight"].clone()
        q[:, ::256] = -q[:, ::256]
        parts = {**parts, "weight": q}
    return parts


def _scale_off_by_one_row(layer, parts, w):
    if _in_bad_block(layer, "mlp.fc2"):
        parts = {**parts, "weight_scale": parts["weight_scale"].roll(1, dims=0)}
    return parts


def _rows_permuted_in_a_head(layer, parts, w):
    """Rows of head 0's query projection stored in reverse order (codes and scales alike)."""
    if _in_bad_block(layer, "attn.qkv_proj"):
        p = torch.arange(parts["weight"].shape[0])
        p[:128] = p[:128].flip(0)
        parts = {k: v[p] for k, v in parts.items()}
    return parts


def _swiglu_halves_swapped(layer, parts, w):
    if _in_bad_block(layer, "mlp.fc1"):
        half = parts["weight"].shape[0] // 2
        p = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
        parts = {k: v[p] for k, v in parts.items()}
    return parts


def _quantized_twice(layer, parts, w):
    """The stored layer re-quantized from its own rotated values (the rotation applied twice)."""
    from h3quant.formats.int8.tensors import encode_int8

    if _in_bad_block(layer, "attn.out_proj"):
        rotated = parts["weight"].float() * parts["weight_scale"].float()
        q, s = encode_int8(rotated, convrot=True, group_size=256, per_row=True, method="dense")
        parts = {"weight": q, "weight_scale": s}
    return parts


DEFECTS = {"hadamard_sign": _wrong_hadamard_sign, "scale_row": _scale_off_by_one_row,
           "head_rows": _rows_permuted_in_a_head, "swiglu_swap": _swiglu_halves_swapped,
           "twice": _quantized_twice}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("compare")
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=BLOCKS, seed=3)
    out = {"dir": d, "bf16": bf16, "int8": quantize_file(bf16, d / "int8.safetensors"),
           "w4a8": quantize_file(bf16, d / "w4a8.safetensors", fmt="w4a8")}
    for name, fn in DEFECTS.items():
        out[name] = quantize_file(bf16, d / f"int8_{name}.safetensors", mutate=fn)
    src, _ = read_all(bf16)
    for q in ("Q8_0", "Q4_0", "Q4_K"):
        out[q] = d / f"h3-{q}.gguf"
        write_gguf(src, out[q], q, prefix="model.diffusion_model." if q == "Q4_0" else "")
    return out


def _card(args, code=0):
    r = CliRunner().invoke(main, ["compare", *args, *SMALL, "--json"])
    assert r.exit_code == code, r.output
    return {rec["path"]: rec for rec in json.loads(r.stdout)["records"]}


def test_defects_rank_below_the_clean_file_and_the_drift_points_at_their_block(files):
    names = ["int8", *DEFECTS]
    recs = _card([str(files[n]) for n in names] + ["--reference", str(files["bf16"]),
                                                   "--steps", "2"], code=1)  # flagged
    clean = recs[str(files["int8"])]
    assert clean["rank"] == 1 and clean["role"] == "file"
    for name in DEFECTS:
        bad = recs[str(files[name])]
        assert bad["rank"] > clean["rank"], name
        assert bad["quality_db"] < clean["quality_db"] - 3, (name, bad["quality_db"])
        assert bad["suspect_block"] == BAD, (name, bad["drift"])
        assert any(f.startswith(f"block {BAD}:") for f in bad["flags"]), (name, bad["flags"])
        # the drift is clean before the broken block and drops at it
        d = {x["block"]: x for x in bad["drift"]}
        c = {x["block"]: x for x in clean["drift"]}
        assert d[0]["sqnr_db"] == pytest.approx(c[0]["sqnr_db"], abs=1e-6), name
        assert d[BAD]["local_sqnr_db"] < c[BAD]["local_sqnr_db"] - 3, name
    ref = next(r for r in recs.values() if r["role"] == "reference")
    assert ref["path"] == str(files["bf16"]) and not ref["reference_chosen"]
    run = ref["run"]
    assert run["steps"] == 2 and run["seed"] == 0 and run["device"] == "cpu"
    assert run["h3quant_version"] and len(run["schedule"]) == 3


def test_without_a_reference_the_most_precise_file_is_taken_and_formats_rank(files, tmp_path):
    md, png = tmp_path / "card.md", tmp_path / "card.png"
    args = [str(files[n]) for n in ("w4a8", "Q4_0", "int8", "bf16", "Q8_0", "Q4_K")]
    r = CliRunner().invoke(main, ["compare", *args, *SMALL, "--steps", "2", "--markdown",
                                  str(md), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "the most precise file given" in r.stdout
    assert md.read_text().startswith("### h3quant compare") and png.read_bytes()[:4] == b"\x89PNG"
    recs = _card(args + ["--steps", "2"])
    ref = next(r for r in recs.values() if r["role"] == "reference")
    assert ref["path"] == str(files["bf16"]) and ref["reference_chosen"]
    q = {n: recs[str(files[n])] for n in ("int8", "w4a8", "Q8_0", "Q4_0", "Q4_K")}
    assert q["Q8_0"]["formats"] == {"gguf:Q8_0": 4 * BLOCKS}
    assert q["Q4_K"]["formats"] == {"gguf:Q4_K": 4 * BLOCKS}
    assert q["Q8_0"]["bits_per_weight"] == pytest.approx(8.5)
    assert q["Q4_0"]["bits_per_weight"] == pytest.approx(4.5)
    assert q["Q4_K"]["bits_per_weight"] == pytest.approx(4.5)
    # 8-bit above 4-bit, whatever the container
    for hi in ("int8", "Q8_0"):
        for lo in ("w4a8", "Q4_0", "Q4_K"):
            assert q[hi]["quality_db"] > q[lo]["quality_db"], (hi, lo)
    assert q["Q8_0"]["size_bytes"] > q["Q4_0"]["size_bytes"]


def test_outputs_follow_the_output_rules(files, tmp_path):
    f, ref = str(files["int8"]), str(files["bf16"])
    r = CliRunner().invoke(main, ["compare", f, "--reference", ref, "--markdown", f, *SMALL])
    assert r.exit_code == 2 and "input" in r.output
    r = CliRunner().invoke(main, ["compare", f, "--reference", f, *SMALL])
    assert r.exit_code == 2 and "twice" in r.output
    r = CliRunner().invoke(main, ["compare", f, *SMALL])
    assert r.exit_code == 2 and "reference" in r.output
    r = CliRunner().invoke(main, ["compare", f, "--reference", ref, "--sigmas", "1,0,0",
                                  *SMALL])
    assert r.exit_code == 2 and "--sigmas" in r.output
    existing = tmp_path / "x.md"
    existing.write_text("keep")
    r = CliRunner().invoke(main, ["compare", f, "--reference", ref, "--markdown",
                                  str(existing), *SMALL, "--steps", "0"])
    assert r.exit_code == 2 and existing.read_text() == "keep"


def test_a_copy_of_the_reference_matches_it_exactly(files, tmp_path):
    import shutil

    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(files["bf16"], copy)
    recs = _card([str(copy), "--reference", str(files["bf16"]), "--steps", "2"])
    c = recs[str(copy)]
    assert c["quality_db"] == "inf" and c["final_latent"]["video"]["psnr_db"] == "inf"
    assert all(d["sqnr_db"] == "inf" and d["local_sqnr_db"] == "inf" for d in c["drift"])
    assert all(s["video_sqnr_db"] == "inf" for s in c["steps"]) and len(c["steps"]) == 2


def test_the_planner_frontier_over_a_float_reference(files, tmp_path):
    png, md = tmp_path / "card.png", tmp_path / "card.md"
    base = [str(files["int8"]), str(files["w4a8"]), *SMALL, "--steps", "0"]
    r = CliRunner().invoke(main, ["compare", *base, "--reference", str(files["bf16"]), "--json",
                                  "--plot", str(png), "--markdown", str(md), "--frontier"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    front = doc["frontier"]
    sizes = [p["predicted_bytes"] for p in front]
    worse = [float(p["predicted_min_sqnr_db"]) for p in front]  # "inf": the float file
    assert len(front) >= 3
    # a frontier: bigger files are predicted better, never worse
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert all(a < b for a, b in zip(worse, worse[1:])), worse
    for p in front:
        assert sum(p["formats"].values()) == BLOCKS
        assert float(p["predicted_min_sqnr_db"]) == min(
            float(v) for v in p["predicted_sqnr_db"].values())
    assert front[0]["formats"] == {"w4a8": BLOCKS} and front[-1]["formats"] == {"bf16": BLOCKS}
    # the noise model's uniform int8 point against the real forward of the int8 file
    int8_point = next(p for p in front if p["formats"] == {"int8-convrot": BLOCKS})
    rec = next(x for x in doc["records"] if x["path"] == str(files["int8"]))
    measured = min(m["sqnr_db"] for m in rec["outputs"].values())
    assert abs(float(int8_point["predicted_min_sqnr_db"]) - measured) < 3, (int8_point, measured)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "#### Planner frontier (predicted)" in md.read_text()
    r = CliRunner().invoke(main, ["compare", *base, "--reference", str(files["bf16"]),
                                  "--json", "--no-frontier"])
    assert r.exit_code == 0, r.output
    assert "frontier" not in json.loads(r.stdout)
    # a quantized reference: no frontier by default, refused when asked for
    r = CliRunner().invoke(main, ["compare", str(files["w4a8"]), "--reference",
                                  str(files["int8"]), *SMALL, "--steps", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert "frontier" not in json.loads(r.stdout)
    r = CliRunner().invoke(main, ["compare", str(files["w4a8"]), "--reference",
                                  str(files["int8"]), *SMALL, "--frontier"])
    assert r.exit_code == 2 and "float reference" in r.output
