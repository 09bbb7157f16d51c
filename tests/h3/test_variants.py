"""Files stock ComfyUI loads though they differ from H3's release: a denser time-embedding
table, extra metadata keys, extra unknown tensors, mixed float dtypes, the
``model.diffusion_model.`` prefix. Each is made here from a synthetic checkpoint with the
safetensors package; inspect lists its note, validate agrees (exit 0, the same notes), and
compare (a float file) or verify --model (an int8 file) runs it. The expected quality comes
from what the variant changed: nothing (the forward must match the original exactly), or a
rounding of the values (close)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3quant.cli import main

SMALL = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "4",
         "--text-tokens", "8", "--device", "cpu"]
PREFIX = "model.diffusion_model."


def _load(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), meta


def _dense_table(t, meta):
    table = t["adaln_t_table"]  # [1025, t]: the same curve at 2049 points (every old row kept)
    dense = torch.nn.functional.interpolate(table.T[None], size=2 * table.shape[0] - 1,
                                            mode="linear", align_corners=True)[0].T
    assert torch.equal(dense[::2], table)
    return {**t, "adaln_t_table": dense.contiguous()}, meta


def _extra_meta(t, meta):
    return t, {**meta, "modelspec.title": "H3 test", "ss_training_comment": "none"}


def _extra_tensors(t, meta):
    return {**t, "blocks.0.attn.extra_gain": torch.ones(4),
            "unused_head.weight": torch.zeros(3, 3)}, meta


def _mixed_dtypes(t, meta):
    out = dict(t)
    for n in t:
        if n.endswith(("norm1.weight", "attn.out_proj.weight")):
            out[n] = t[n].float()  # BF16 -> F32: exact
        elif "adaln_proj" in n:
            out[n] = t[n].half()  # BF16 -> F16: rounded where F16 lacks the range
        elif n.startswith("video_patch_proj"):
            out[n] = t[n].bfloat16()  # F32 -> BF16: rounded
    return out, meta


def _prefixed(t, meta):
    """Every name behind the prefix, the header's marker table too (as a full checkpoint)."""
    meta = dict(meta)
    if "_quantization_metadata" in meta:
        table = json.loads(meta["_quantization_metadata"])
        table["layers"] = {PREFIX + k: v for k, v in table["layers"].items()}
        meta["_quantization_metadata"] = json.dumps(table)
    return {PREFIX + k: v for k, v in t.items()}, meta


# variant -> (maker, note codes inspect lists, least output SQNR against the original)
VARIANTS = {
    "dense_table": (_dense_table, {"T107"}, 80.0),
    "extra_meta": (_extra_meta, {"M116"}, float("inf")),
    "extra_tensors": (_extra_tensors, {"T108"}, float("inf")),
    "mixed_dtypes": (_mixed_dtypes, {"T109"}, 40.0),
    "prefix": (_prefixed, {"T110"}, float("inf")),
}


@pytest.fixture(scope="module")
def src(tp_files):
    """The session's tiny BF16 file and its int8 ConvRot conversion."""
    return tp_files


def _notes(path):
    r = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _validate(path):
    r = CliRunner().invoke(main, ["validate", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_float_variant_is_noted_and_compared(src, tmp_path, name):
    make, codes, least = VARIANTS[name]
    tensors, meta = make(*_load(src["bf16"]))
    f = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(f), metadata=meta)
    info = _notes(f)
    assert {n["code"] for n in info["notes"]} == codes, info["notes"]
    assert info["findings"] == {"error": 0, "warning": 0, "info": len(info["notes"])}
    doc = _validate(f)  # one verdict: validate lists the same notes, nothing else
    assert sorted(x["code"] for x in doc["findings"]) == sorted(n["code"] for n in info["notes"])
    assert all(x["severity"] == "info" for x in doc["findings"])
    r = CliRunner().invoke(main, ["compare", str(f), "--reference", str(src["bf16"]), *SMALL,
                                  "--steps", "0", "--no-frontier", "--json"])
    assert r.exit_code == 0, r.output
    rec = next(x for x in json.loads(r.stdout)["records"] if x["path"] == str(f))
    got = [float(m["sqnr_db"]) for m in rec["outputs"].values()]
    assert len(got) == 2 and all(v >= least for v in got), (name, got)
    if least < float("inf"):  # the variant changed values: the card sees it
        assert any(v < float("inf") for v in got), got


def test_an_int8_variant_is_verified(src, tmp_path):
    """Prefix, extra metadata and an extra tensor on a quantized file: verify --model runs it
    and gets what it gets for the file as converted."""
    tensors, meta = _load(src["int8"])
    tensors, meta = _prefixed(*_extra_tensors(*_extra_meta(tensors, meta)))
    f = tmp_path / "int8_variant.safetensors"
    save_file(tensors, str(f), metadata=meta)
    info = _notes(f)
    assert {n["code"] for n in info["notes"]} == {"M116", "T108", "T110"}, info["notes"]
    assert info["findings"]["error"] == info["findings"]["warning"] == 0
    _validate(f)
    out = {}
    for path in (src["int8"], f):
        r = CliRunner().invoke(main, ["verify", str(path), "--model", "--reference",
                                      str(src["bf16"]), *SMALL, "--json"])
        assert r.exit_code == 0, r.output
        out[path] = {o["name"]: o["sqnr_db"] for o in json.loads(r.stdout)["outputs"]}
    assert out[f] == out[src["int8"]]
