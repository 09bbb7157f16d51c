"""A broken file never succeeds in compare: a NaN block scale (nvfp4, a Q8_0 GGUF), a NaN
or infinite scale, a finite scale whose decoded weights overflow; each gets validate --deep's
finding, the last rank, and exit 1, whether it is compared alone or beside good files. A broken
reference is refused. Files are the tiny synthetic H3 converted and edited here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.gguf_files import write_gguf
from helpers.h3files import read_tensors as read_all

from helpers.cli import run

from h3quant.synth import synth_checkpoint

L = "blocks.0.mlp.fc1"
SMALL = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "2",
         "--text-tokens", "4", "--device", "cpu", "--no-frontier"]


def _edit(src, dst, fn):
    t = load_file(str(src))
    fn(t)
    save_file(t, str(dst))
    return dst


def _nan_byte(t, name, code=0x7F):
    raw = t[name].view(torch.uint8).clone()
    raw.view(-1)[3] = code
    t[name] = raw.view(t[name].dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("broken")
    base = d / "bf16.safetensors"
    synth_checkpoint(base, preset="tiny", blocks=1, seed=3, workers=1)
    out = {"bf16": base}
    for to in ("nvfp4", "int8"):
        out[to] = d / f"{to}.safetensors"
        assert run("convert", base, out[to], "--to", to, "--no-report", "-q").exit_code == 0
    out["nvfp4 NaN block scale"] = _edit(out["nvfp4"], d / "nvfp4-nan.safetensors",
                                         lambda t: _nan_byte(t, f"{L}.weight_scale"))

    def _inf_row(t):
        t[f"{L}.weight_scale"] = t[f"{L}.weight_scale"].clone()
        t[f"{L}.weight_scale"][2] = float("inf")
    out["int8 inf scale"] = _edit(out["int8"], d / "int8-inf.safetensors", _inf_row)
    out["nvfp4 scale_2 3e38"] = _edit(out["nvfp4"], d / "nvfp4-big.safetensors",
                                      lambda t: t.__setitem__(f"{L}.weight_scale_2",
                                                              torch.tensor(3e38)))
    src, _ = read_all(base)
    q8 = d / "h3-Q8_0.gguf"
    write_gguf(src, q8, "Q8_0")
    out["Q8_0"] = q8
    raw = bytearray(q8.read_bytes())
    from h3quant.formats.gguf import GgufFile

    with GgufFile(q8) as g:  # the first block's fp16 scale of a Q8_0 tensor set to NaN
        t = next(t for t in g.tensors.values() if t.qtype == "Q8_0")
        at, _ = g.byte_range(t.name, 0, 32)
    raw[at:at + 2] = np.array([np.nan], np.float16).tobytes()
    out["Q8_0 NaN block scale"] = d / "h3-Q8_0-nan.gguf"
    out["Q8_0 NaN block scale"].write_bytes(bytes(raw))
    return out


BROKEN = ["nvfp4 NaN block scale", "Q8_0 NaN block scale", "int8 inf scale",
          "nvfp4 scale_2 3e38"]


@pytest.mark.parametrize("name,with_good", [(n, i % 2 == 1) for i, n in enumerate(BROKEN)])
def test_a_broken_file_fails_and_ranks_last(files, name, with_good):
    args = [files[name]] + ([files["int8"]] if with_good else [])
    res = run("compare", *args, "--reference", files["bf16"], *SMALL, "--json")
    assert res.exit_code == 1, res.output
    recs = {r["path"]: r for r in json.loads(res.stdout)["records"]}
    bad = recs[str(files[name])]
    assert bad["rank"] == len(args) and bad["failures"], bad
    assert any(f.startswith(("[D1", "[G104]")) for f in bad["failures"]), bad["failures"]
    v = run("validate", files[name], "--deep", "--json")
    codes = {f["code"] for f in json.loads(v.stdout)["findings"] if f["severity"] == "error"}
    assert v.exit_code == 1 and any(f"[{c}]" in " ".join(bad["failures"]) for c in codes)
    if with_good:
        assert recs[str(files["int8"])]["rank"] == 1
    text = run("compare", *args, "--reference", files["bf16"], *SMALL)
    assert text.exit_code == 1 and "FAILED" in text.output and str(files[name]) in text.output


def test_a_broken_reference_is_refused(files):
    res = run("compare", files["int8"], "--reference", files["nvfp4 NaN block scale"], *SMALL)
    assert res.exit_code == 1 and "reference fails validate --deep" in res.output, res.output


def test_good_files_still_pass(files):
    res = run("compare", files["int8"], files["Q8_0"], files["nvfp4"], "--reference",
              files["bf16"], *SMALL, "--json")
    assert res.exit_code == 0, res.output
    ranks = sorted(r["rank"] for r in json.loads(res.stdout)["records"] if r["role"] == "file")
    assert ranks == [1, 2, 3]
