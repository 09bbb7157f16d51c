"""comfy-kitchen quantizing bf16 weights to int8 works in bf16 (rotation, row peaks, division by
the scale rounded to bf16): a valid file with a larger error than the float32 encode. The fresh
encode behind relative verdicts makes that encode too, byte for byte, and holds such layers to
the worse of the two, so verify --model no longer flags kitchen's bf16-made file while a planted
defect in it is still caught. Files: the tiny synthetic H3 (figures say how the code behaves,
not how a released H3 looks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_verdicts import _edit_safetensors, kitchen_file  # noqa: E402

from helpers.cli import SMALL  # noqa: E402

from h3quant.cli import main  # noqa: E402


@pytest.mark.parametrize("dtype,convrot,g,n,k", [
    (torch.bfloat16, True, 256, 96, 512), (torch.bfloat16, True, 256, 300, 768),
    (torch.float16, True, 64, 64, 256), (torch.bfloat16, False, 256, 80, 320)])
def test_the_in_dtype_encode_is_kitchens_from_such_weights(dtype, convrot, g, n, k):
    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor

    from h3quant.formats.int8.tensors import encode_int8, encode_int8_in_dtype

    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.02).to(dtype)
    kw = {"convrot": True, "convrot_groupsize": g} if convrot else {}
    with ck.registry.use_backend("eager"):
        sd = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True,
                                        **kw).state_dict("x.weight")
    q, s = encode_int8_in_dtype(w, convrot=convrot, group_size=g)
    assert torch.equal(q, sd["x.weight"])
    assert torch.equal(s, sd["x.weight_scale"].float().reshape(-1, 1))
    q32, _ = encode_int8(w.float(), convrot=convrot, group_size=g)
    assert not torch.equal(q, q32)  # the arithmetic shows: another encode than float32's


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    out = {}
    for seed, blocks in ((61, 2), (62, 4)):
        d = tmp_path_factory.mktemp(f"bf16-{seed}-{blocks}")
        ref = d / "bf16.safetensors"
        synth_checkpoint(ref, preset="tiny", blocks=blocks, seed=seed, workers=1)
        f = kitchen_file(ref, d / "int8-bf16.safetensors", "int8-convrot", from_float32=False)
        out[seed, blocks] = (ref, f)
    return out


def _verify(*args):
    r = CliRunner().invoke(main, ["verify", *map(str, args), "--json"])
    assert "Traceback" not in r.output
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize("key", [(61, 2), (62, 4)])
def test_kitchens_bf16_made_int8_passes_verify_model(made, key):
    """Seed 61: video 22.09 dB; the float32 fresh encode gave 30.1 dB, a 25.1 dB limit that
    failed the file; the encode kitchen makes from bf16 is the file itself."""
    ref, f = made[key]
    code, doc = _verify(f, "--reference", ref, "--model", *SMALL)
    assert code == 0, doc
    assert "as comfy-kitchen encodes BF16 weights" in doc["expected"]["what"]
    for o in doc["outputs"]:
        assert o["passed"] and o["limit_db"] == pytest.approx(
            doc["expected"]["outputs"][o["name"]] - 5, abs=0.01)
    code, doc = _verify(f, "--reference", ref, "--device", "cpu")
    assert code == 0, doc


def test_a_defect_in_the_bf16_made_file_is_still_flagged(made, tmp_path):
    ref, f = made[61, 2]
    bad, blocks = _edit_safetensors(f, tmp_path / "scaled.safetensors", "scale x1.5",
                                    "int8-convrot")
    code, doc = _verify(bad, "--reference", ref, "--device", "cpu")
    assert code == 1
    assert any(f"blocks.{b}." in x or f"block {b}" in x for x in doc["failures"] for b in blocks)
    code, doc = _verify(bad, "--reference", ref, "--model", *SMALL)
    assert code == 1 and not all(o["passed"] for o in doc["outputs"]), doc["outputs"]
