"""``capture --tp 2``: two CPU ranks (gloo) give the single-process capture's statistics.

Tolerance: the sharded blocks sum out_proj's and fc2's partial products across ranks in fp32,
so each block's output (the next block's input) differs from one device by float32 rounding
(~1e-7 relative), carried through the following blocks; the statistics are then compared with
rtol 1e-4 and an absolute floor of 1e-5 of each tensor's largest magnitude (entries of H near
zero are sums of cancelling terms)."""

from __future__ import annotations

import pytest
import torch

from h3quant.synth import synth_checkpoint

from helpers.cli import run
from helpers.inputs import input_dims, seeded_inputs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics

    d = tmp_path_factory.mktemp("tp")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=3)
    ins = seeded_inputs(d, input_dims(src), range(2))
    one, two = d / "one.stats", d / "two.stats"
    capture_statistics(src, ins, one, predict=False)
    capture_statistics(src, ins, two, predict=False, tp=2, memory_budget=600_000)  # one call held, one spilled
    return {"d": d, "src": src, "ins": ins, "one": one, "two": two}


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def test_tp2_capture_equals_the_single_process_capture(pair):
    one, meta1 = _tensors(pair["one"])
    two, meta2 = _tensors(pair["two"])
    assert meta1 == meta2
    assert one.keys() == two.keys() and len(one) == 2 * 4 * 4
    for k, a in one.items():
        b = two[k]
        assert a.shape == b.shape, k
        floor = 1e-5 * float(a.abs().max())
        assert torch.allclose(b, a, rtol=1e-4, atol=floor), \
            f"{k}: max diff {float((b - a).abs().max())}"
    # the row-parallel layers' gathered inputs are not trivially equal to one rank's slice
    assert float(one["blocks.1.mlp.fc2.absmax"].abs().max()) > 0


def test_tp2_leaves_no_spill_folder(pair):
    assert not any(p.name.endswith(".h3q-spill") for p in pair["d"].iterdir())


@pytest.mark.parametrize("case,words", [("through", "--through"), ("quantized", "float")])
def test_tp_refuses_unsupported_combinations(pair, case, words):
    from h3quant.pipelines.convert import ConvertOptions, convert

    out = pair["d"] / "refused.stats"
    ckpt, extra = pair["src"], ["--through", str(pair["src"])]
    if case == "quantized":
        ckpt, extra = pair["d"] / "int8.safetensors", []
        convert(pair["src"], ckpt, ConvertOptions(target="int8", report=False, overwrite=True))
    r = run("capture", ckpt, "--inputs", pair["ins"][0], "--out", out,
            "--tp", "2", "--no-predict", *extra)
    assert r.exit_code == 2, r.output
    assert words in r.output and "--tp" in r.output and "Traceback" not in r.output
    assert not out.exists()
