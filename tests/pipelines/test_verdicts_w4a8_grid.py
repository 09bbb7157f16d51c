"""An int8 file converted from W4A8 carries W4A8's error. Without the header's note, its ConvRot
rows on W4A8's decoded grid tell: the relative verdicts (the default of verify, verify --model
and compare) then hold such layers to a fresh W4A8 encode of the reference, and the verdict line
says so; an int8 file made from floats keeps the int8 encode. Files: a one-block synthetic H3."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.cli import run


KEY = "h3quant.from_w4a8"
GRID = "rows on a W4A8 grid"


def rewrite(src, dst, edit=None, *, drop_note=False):
    """``src`` copied after ``edit(tensors)``; ``drop_note``: without the header's from-W4A8
    note (a file another tool made)."""
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata() or {})
    if drop_note:
        meta.pop(KEY)
    t = load_file(str(src))
    if edit is not None:
        edit(t)
    save_file(t, str(dst), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grid")
    out = {"bf16": d / "bf16.safetensors", "w4a8": d / "w4a8.safetensors"}
    assert run("synth", out["bf16"], "--blocks", "1", "-q").exit_code == 0
    assert run("convert", out["bf16"], out["w4a8"], "--to", "w4a8", "-q").exit_code == 0
    for name, opts in {"int8": [], "kn": ["--layout", "npu"]}.items():
        noted = d / f"{name}-noted.safetensors"
        assert run("convert", out["w4a8"], noted, "--to", "int8-convrot", *opts,
                   "-q").exit_code == 0
        out[name] = rewrite(noted, d / f"{name}.safetensors", drop_note=True)
    out["direct"] = d / "direct.safetensors"
    assert run("convert", out["bf16"], out["direct"], "--to", "int8-convrot", "-q").exit_code == 0
    return out


def verify(path, ref, *extra):
    res = run("verify", path, "--reference", ref, "--device", "cpu", "--json", *extra)
    return res.exit_code, json.loads(res.stdout)


def _notes(doc) -> str:
    return " ".join(doc["notes"])


@pytest.mark.parametrize("layout", ["int8", "kn"])
def test_an_int8_file_on_a_w4a8_grid_without_the_note_is_held_to_a_w4a8_encode(files, layout):
    code, doc = verify(files[layout], files["bf16"], "--tokens", "16")
    assert code == 0, doc["failures"]
    notes = _notes(doc)
    assert "encoded afresh as asym_w4a8_int8" in notes and "4 int8 layers as W4A8" in notes
    assert GRID in notes and "12 dB" in notes
    text = run("verify", files[layout], "--reference", files["bf16"], "--device", "cpu",
               "--tokens", "16")
    assert text.exit_code == 0 and GRID in text.output and "as W4A8" in text.output


def test_verify_model_and_compare_say_so_too(files):
    code, doc = verify(files["int8"], files["bf16"], "--model", "--frames", "1", "--height",
                       "8", "--width", "8", "--audio-frames", "8", "--text-tokens", "8")
    assert code == 0, doc["failures"]
    assert "asym_w4a8_int8" in doc["expected"]["what"] and GRID in doc["expected"]["what"]
    assert doc["expected"]["margin_db"] == 12.0
    res = run("compare", files["int8"], files["direct"], "--reference", files["bf16"],
              "--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "2",
              "--text-tokens", "4", "--device", "cpu", "--steps", "0", "--json")
    recs = {r["path"]: r for r in json.loads(res.stdout)["records"] if r["role"] == "file"}
    grid, direct = recs[str(files["int8"])], recs[str(files["direct"])]
    assert not grid["flags"] and GRID in grid["expected"]["what"], grid
    assert not direct["flags"] and "as W4A8" not in direct["expected"]["what"], direct


def test_an_int8_file_from_floats_keeps_the_int8_encode(files):
    from h3quant.pipelines.fresh_encode import file_layers

    layers, _, as_w4a8 = file_layers(str(files["direct"]))
    assert as_w4a8 == {} and {f["format"] for f in layers.values()} == {"int8_tensorwise"}
    layers, _, as_w4a8 = file_layers(str(files["int8"]))
    assert set(as_w4a8) == set(layers) and all(w.startswith(GRID) for w in as_w4a8.values())


def test_a_defect_on_the_w4a8_grid_is_still_flagged(files, tmp_path):
    def swap_rows(t):  # one layer's codes and scales rolled by one row: still on the grid
        name = "blocks.0.mlp.fc1"
        for s in ("weight", "weight_scale"):
            t[f"{name}.{s}"] = torch.roll(t[f"{name}.{s}"], 1, 0).contiguous()

    bad = rewrite(files["int8"], tmp_path / "bad.safetensors", swap_rows)
    code, doc = verify(bad, files["bf16"], "--tokens", "16")
    assert code == 1 and any("blocks.0.mlp.fc1" in f for f in doc["failures"]), doc["failures"]
    assert GRID in _notes(doc)

