"""A square NPU-layout layer gets one verdict; an output named like h3quant's staging directory
is refused, and a directory merely named like one is never removed by a later run."""

from __future__ import annotations

import json
import os

import pytest
from hostile_util import sha, tiny_base
from safetensors import safe_open
from safetensors.torch import save_file

from helpers.cli import run

from h3quant.formats import registry
from h3quant.formats.container import atomic

# every target convert can write without calibration data (a format that needs it refuses
# with its own usage error before reading any weight)
TARGETS = sorted(t for t in registry.targets()
                 if not registry.target_codec(t).spec.encoding.write_refusal)
SQUARE = "blocks.0.attn.out_proj.weight"  # [512, 512] in the tiny preset


@pytest.fixture(scope="module")
def kn(tmp_path_factory):
    d = tmp_path_factory.mktemp("kn")
    base = tiny_base(d / "base.safetensors", blocks=1)
    good = d / "kn.safetensors"
    assert run("convert", base, good, "--layout", "npu", "--no-report", "-q").exit_code == 0
    with safe_open(str(good), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert t[SQUARE].shape[0] == t[SQUARE].shape[1]
    t[SQUARE] = t[SQUARE].t().contiguous()  # canonical codes under the kn marker
    bad = d / "square.safetensors"
    save_file(t, str(bad), metadata=meta)
    return {"dir": d, "base": base, "good": good, "bad": bad}


def _verdicts(kn, path, tmp_path) -> dict:
    out = {}
    doc = json.loads(run("validate", path, "--deep", "--json").stdout)
    out["validate --deep"] = sorted({f["code"] for f in doc["findings"] if f["severity"] == "error"})
    res = run("verify", path, "--blocks", "1")
    out["verify"] = res.exit_code
    res = run("verify", path, "--blocks", "1", "--reference", kn["base"])
    out["verify --reference"] = res.exit_code
    for to in TARGETS:
        o = tmp_path / f"{to}.safetensors"
        res = run("convert", path, o, "--to", to, "--no-report", "-q", "--overwrite")
        out[f"convert --to {to}"] = res.exit_code
    return out


@pytest.mark.slow
def test_a_valid_kn_file_passes_everywhere(kn, tmp_path):
    v = _verdicts(kn, kn["good"], tmp_path)
    assert v.pop("validate --deep") == []
    assert set(v.values()) == {0}, v


def test_a_square_kn_layer_stored_untransposed_gets_one_verdict(kn, tmp_path):
    v = _verdicts(kn, kn["bad"], tmp_path)
    assert v.pop("validate --deep") == ["D107"]
    assert set(v.values()) == {1}, v  # every command refuses it as a finding


@pytest.mark.parametrize("name", [".h3quant-staging-1-abc.tmp", ".h3quant-staging-9-x.new"])
def test_an_output_named_like_staging_is_refused(kn, name):
    out = kn["dir"] / name
    res = run("convert", kn["base"], out, "--no-report")
    assert res.exit_code == 2 and "reserved" in res.output, res.output
    assert not out.exists()


def test_an_output_directory_named_like_staging_survives_a_later_run(kn, tmp_path):
    """An OUT directory named like a staging directory (written before such names were
    refused) holds h3quant's output manifest: a later run beside it never removes it."""
    keep = tmp_path / ".h3quant-staging-77-mine.tmp"
    keep.mkdir()
    (keep / "model.safetensors").write_bytes(kn["good"].read_bytes())
    atomic.write_manifest(keep)
    before = sha(keep / "model.safetensors")
    res = run("convert", kn["base"], tmp_path / "o.safetensors", "--no-report", "-q")
    assert res.exit_code == 0, res.output
    assert sha(keep / "model.safetensors") == before
    # a real stale staging directory beside it is still cleaned
    stale = tmp_path / ".h3quant-staging-78-dead.tmp"
    for sub in (atomic.NEW_DIR, atomic.OLD_DIR):
        os.makedirs(stale / sub)
    (stale / atomic.LOCK_NAME).write_text("")
    res = run("convert", kn["base"], tmp_path / "o2.safetensors", "--no-report", "-q")
    assert res.exit_code == 0 and not stale.exists() and keep.exists()
