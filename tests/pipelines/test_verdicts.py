"""Relative verdicts: verify and compare judge a file against a fresh plain encode of the reference
in the file's own formats, rank flagged and failing files below clean ones by the limiting
stream, and call differences under the measured noise floor ties. Files are the tiny synthetic
H3 quantized here by comfy-kitchen's own quantizers (and a Q8_0 GGUF by the gguf package), with
defects planted in them here; bench/bench_verdicts.py runs the whole matrix of seeds and formats."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_verdicts import KITCHEN, _edit_gguf, _edit_safetensors, kitchen_file  # noqa: E402

from helpers.cli import SMALL, run  # noqa: E402

from h3quant.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from helpers.gguf_files import write_gguf

    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("verdicts")
    ref = d / "bf16.safetensors"
    synth_checkpoint(ref, preset="tiny", blocks=2, seed=61, workers=1)
    out = {"ref": ref}
    for fmt in ("nvfp4", "int8-convrot"):
        out[fmt] = kitchen_file(ref, d / f"{fmt}.safetensors", fmt)
    out["Q8_0"] = d / "Q8_0.gguf"
    write_gguf(load_file(str(ref)), out["Q8_0"], "Q8_0")
    plant = [("nvfp4", "rows rolled"), ("int8-convrot", "scale x1.5"),
             ("nvfp4", "NaN block scales"), ("Q8_0", "blocks swapped")]
    for fmt, defect in plant:
        tag = defect.replace(" ", "_").replace(".", "")
        if fmt == "Q8_0":
            out[f"{fmt} {defect}"] = _edit_gguf(out[fmt], d / f"{fmt}-{tag}.gguf", defect)
        else:
            out[f"{fmt} {defect}"] = _edit_safetensors(out[fmt], d / f"{fmt}-{tag}.safetensors",
                                                       defect, fmt)
    return out


def test_the_fresh_encode_is_kitchens_own(files, tmp_path):
    """The reference re-encoded as the kitchen file's format holds the bytes comfy-kitchen
    wrote from the float32 weights; for int8 layers of this bf16 reference, the second encode
    holds the bytes kitchen writes from the bf16 weights as stored."""
    from h3quant.pipelines.fresh_encode import write_fresh_encode

    bf16_made = load_file(str(kitchen_file(files["ref"], tmp_path / "int8-bf16.st",
                                           "int8-convrot", from_float32=False)))
    for fmt, in_dtype in (("nvfp4", False), ("int8-convrot", False), ("int8-convrot", True)):
        out = tmp_path / f"{fmt}-{in_dtype}.st"
        enc = write_fresh_encode(str(files[fmt]), str(files["ref"]), str(out), in_dtype=in_dtype)
        assert enc.complete and len(enc.encoded) == 8, enc
        assert enc.in_dtype == ({n: "BF16" for n in enc.encoded} if fmt == "int8-convrot"
                                else {}), enc.in_dtype
        want, got = (bf16_made if in_dtype else load_file(str(files[fmt]))), load_file(enc.path)
        for k, v in want.items():
            if k.endswith("comfy_quant"):
                continue
            w = got[k]
            if v.dtype.itemsize == 1:
                v, w = v.view(torch.uint8), w.view(torch.uint8)
            assert torch.equal(v, w), (fmt, in_dtype, k)


def test_the_gguf_encode_is_the_gguf_packages(files, tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from h3quant.pipelines.fresh_encode import write_fresh_encode

    enc = write_fresh_encode(str(files["Q8_0"]), str(files["ref"]), str(tmp_path / "q8.st"))
    assert enc.complete and set(enc.encoded.values()) == {"gguf:Q8_0"}
    w = load_file(str(files["ref"]))["blocks.1.mlp.fc1.weight"].float().numpy()
    q = quants.quantize(w, GGMLQuantizationType.Q8_0)
    want = quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(w.shape)
    got = load_file(enc.path)["blocks.1.mlp.fc1.weight"].numpy()
    assert np.array_equal(got, want)


def test_a_kitchen_nvfp4_file_passes_verify_model_where_the_fixed_limit_failed_it(files):
    """comfy-kitchen's nvfp4 of the seed-61 tiny model sits under the fixed 9 dB nvfp4 limit on
    audio; against its own format's fresh encode it passes."""
    r = run("verify", files["nvfp4"], "--reference", files["ref"], "--model", *SMALL, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert doc["expected"]["outputs"] and "nvfp4" in doc["expected"]["what"]
    for o in doc["outputs"]:
        assert o["limit_db"] == pytest.approx(doc["expected"]["outputs"][o["name"]] - 5, abs=0.01)
    r = run("verify", files["nvfp4"], "--reference", files["ref"], "--model", *SMALL,
            "--no-expected", "--json")
    fixed = json.loads(r.stdout)
    assert fixed["expected"] is None and all(o["limit_db"] == 9.0 for o in fixed["outputs"])


def test_kitchens_int8_made_from_bf16_weights_passes_verify(files, tmp_path):
    """comfy-kitchen quantizing bf16 weights rotates and scales in bf16, so its int8 rows peak
    at 126-128 (with -128 codes) instead of 127: a valid file that verify must not fail."""
    f = kitchen_file(files["ref"], tmp_path / "int8-bf16.safetensors", "int8-convrot",
                     from_float32=False)
    q = load_file(str(f))["blocks.0.mlp.fc2.weight"]
    peaks = torch.maximum(q.amax(1).int(), -q.amin(1).int())
    assert int(peaks.max()) == 128 or int(peaks.min()) < 127  # the bf16 arithmetic shows
    r = run("verify", f, "--reference", files["ref"], "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert all(d["passed"] for d in json.loads(r.stdout)["data"] if d["check"] == "row-range")


def test_verify_flags_a_planted_defect_by_block_and_layer(files):
    r = run("verify", files["int8-convrot scale x1.5"][0], "--reference", files["ref"],
            "--device", "cpu", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert any(f.startswith("block 1:") for f in doc["failures"]), doc["failures"]
    assert any("blocks.1.mlp.fc2" in f for f in doc["failures"]), doc["failures"]
    assert not any("blocks.0." in f or f.startswith("block 0") for f in doc["failures"])
    ok = run("verify", files["int8-convrot"], "--reference", files["ref"], "--device", "cpu")
    assert ok.exit_code == 0, ok.output


def test_compare_flags_defects_names_the_block_and_ranks_them_below_clean_files(files):
    clean = [files[k] for k in ("nvfp4", "int8-convrot", "Q8_0")]
    bad = {k: v for k, v in files.items() if " " in k}
    r = run("compare", *clean, *(p for p, _ in bad.values()), "--reference", files["ref"],
            *SMALL, "--steps", "0", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    recs = {rec["path"]: rec for rec in doc["records"] if rec["role"] == "file"}
    worst_clean = max(recs[str(p)]["rank"] for p in clean)
    for p in clean:
        rec = recs[str(p)]
        assert not rec["flags"] and not rec["failures"] and rec["expected"], rec
    for name, (p, blocks) in bad.items():
        rec = recs[str(p)]
        assert rec["rank"] > worst_clean, name
        text = " ".join(rec["flags"] + rec["failures"])
        assert any(f"block {b}" in text or f"blocks.{b}." in text for b in blocks), (name, text)
    # the clean files in the order of their limiting stream's one-forward SQNR
    qs = [float(recs[str(p)]["quality_db"]) for p in sorted(clean, key=lambda p:
                                                            recs[str(p)]["rank"])]
    assert qs == sorted(qs, reverse=True)
    for p in clean:
        rec = recs[str(p)]
        s = rec["limiting_stream"]
        assert float(rec["quality_db"]) == min(float(m["sqnr_db"]) for m in
                                               rec["outputs"].values())
        assert float(rec["outputs"][s]["sqnr_db"]) == float(rec["quality_db"])
    floor = doc["noise_floor"]
    assert float(floor["video"]) > 80 and float(floor["audio"]) > 80  # float32 on the CPU
    text = run("compare", clean[0], bad["nvfp4 rows rolled"][0], "--reference", files["ref"],
               *SMALL, "--steps", "0")
    assert "FLAGGED" in text.output and "noise floor" in text.output
    assert "not GPU speed" in text.output and "higher is better" in text.output


def _card(name, q, flags=(), failures=(), outputs=None):
    from h3quant.pipelines.compare.card import FileCard, Metric
    from h3quant.pipelines.compare.facts import FileFacts

    c = FileCard(FileFacts(name, "safetensors", 1, 8.0, {"x": 1}), "file")
    for k, v in (outputs or {"video": q + 1, "audio": q}).items():
        c.outputs[k] = Metric(v, 10 ** (-v / 20), 1.0)
    c.flags, c.failures = list(flags), list(failures)
    return c


def test_ranking_puts_flags_then_failures_last_and_ties_within_the_floor():
    from h3quant.pipelines.compare.card import rank, tie_db

    cards = [_card("flagged-high", 40, flags=["block 1: ..."]), _card("clean-low", 10),
             _card("nan", 0, outputs={"video": math.nan, "audio": 5.0}),
             _card("clean-high", 30), _card("clean-high-2", 29.99)]
    rank(cards, floor_db=60.0)
    by = {c.facts.path: c for c in cards}
    assert [c.facts.path for c in sorted(cards, key=lambda c: c.rank)] == [
        "clean-high", "clean-high-2", "clean-low", "flagged-high", "nan"]
    assert by["clean-high-2"].tie and by["clean-high-2"].rank == by["clean-high"].rank == 1
    assert not by["clean-low"].tie and by["clean-low"].rank == 3
    assert by["nan"].failures and by["nan"].rank == 5
    assert by["clean-low"].limiting_stream == "audio"
    # the tie tolerance grows as the error nears the floor, and vanishes far below it
    assert tie_db(30, 60) == pytest.approx(20 * math.log10(1 + 10 ** (-1.5)))
    assert tie_db(30, 150) < 1e-5 and tie_db(30, None) == 0.0
    rank(cards, floor_db=150.0)  # a float32 CPU floor: 0.01 dB is no tie
    assert not by["clean-high-2"].tie and by["clean-high-2"].rank == 2


def test_the_frontier_is_opt_in():
    from h3quant.pipelines.compare.run import CompareOptions

    assert CompareOptions().frontier is False
    r = CliRunner().invoke(main, ["compare", "--help"])
    assert r.exit_code == 0 and "--frontier / --no-frontier" in r.output and "[default: no-frontier]" in r.output


def test_plot_numbers_its_files_fits_its_axes_and_shows_both_streams(files, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from h3quant.cli import compare_view
    from h3quant.sizes import MB
    from h3quant.pipelines.compare.run import CompareOptions, compare_files
    from h3quant.pipelines.verify.model import ModelInputs

    res = compare_files([files["nvfp4"], files["int8-convrot"]], reference=files["ref"],
                        options=CompareOptions(inputs=ModelInputs(1, 4, 4, 2, 4),
                                               device="cpu"))
    seen = {}
    real = plt.close

    def keep(fig):
        seen["fig"] = fig
        real(fig)

    monkeypatch.setattr(plt, "close", keep)
    png = compare_view.plot_png(res)
    assert png[:4] == b"\x89PNG"
    ax = seen["fig"].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == [f"{c.rank} {Path(c.facts.path).name}" for c in res.ranked()]
    vals = [m.sqnr_db for c in res.files for m in c.outputs.values()]
    lo, hi = ax.get_ylim()
    assert lo < min(vals) and hi > max(vals) and hi - lo < (max(vals) - min(vals)) * 1.5
    sizes = [c.facts.size_bytes / MB for c in res.files]
    xlo, xhi = ax.get_xlim()
    assert xlo <= min(sizes) and xhi >= max(sizes)
    assert "higher is better" in ax.get_ylabel()
    assert "audio" in ax.get_title() and "video" in ax.get_title()


@pytest.mark.slow
def test_one_seed_of_the_matrix_per_size(tmp_path):
    """One seed of bench/bench_verdicts.py's matrix per model size (tiny, 2 and 4 blocks): 6
    kitchen formats, int8-convrot also as kitchen makes it from the bf16 weights, and a Q8_0
    GGUF, every planted defect in nvfp4, int8-convrot and Q8_0. The
    bench runs the whole matrix (10 seeds per size); its figures are in docs/benchmarks.md."""
    import bench_verdicts

    stats = {"floor": [], "clean_block": [], "clean_output": [], "clean_q": {},
             "clean_by_fmt": {}, "defect_block": []}
    problems = []
    for blocks, seed in ((2, 100), (4, 101)):
        problems += bench_verdicts.run_one(seed, blocks, tmp_path, True, stats)
    assert not problems, problems
    assert len(stats["clean_block"]) == 2 * (len(KITCHEN) + 2)


def test_the_calibrated_convert_summary_gives_the_output_sqnr_on_the_statistics():
    from h3quant.cli.render import summary_line
    from h3quant.pipelines.convert.result import summarize

    def layer(name, rel, cal=None):
        d = {"name": name, "metrics": {"weight_rel_l2": rel, "output_rel_l2": rel,
                                       "sqnr_db": -20 * math.log10(rel)}}
        if cal is not None:
            d["calibration"] = {"predicted_gain_db": 1.0, "output_sqnr_db": cal}
        return d

    plain = summarize([layer("a", 0.1), layer("b", 0.2)])
    assert "mean_output_sqnr_db_calibration" not in plain
    assert "calibration statistics" not in summary_line(plain)
    cal = summarize([layer("a", 0.1, {"calibration": 30.0, "heldout": 28.0}),
                     layer("b", 0.2, {"calibration": 26.0, "heldout": 25.0}),
                     layer("c", 0.2, {"calibration": float("inf")})])
    assert cal["mean_output_sqnr_db_calibration"] == pytest.approx(28.0)
    assert cal["mean_output_sqnr_db_heldout"] == pytest.approx(26.5)
    line = summary_line(cal)
    assert "output SQNR on the calibration statistics mean 28.0 dB over 2" in line
    assert "held-out statistics 26.5 dB" in line and "mean weight SQNR" in line
