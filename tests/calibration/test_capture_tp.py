"""``capture --tp 2``: two CPU ranks (gloo) give the single-process capture's statistics
(within the tolerance of ``helpers.stats_compare``)."""

from __future__ import annotations

import pytest

from h3quant.synth import synth_checkpoint

from helpers.cli import run
from helpers.inputs import input_dims, seeded_inputs
from helpers.stats_compare import assert_same_statistics


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


def test_tp2_capture_equals_the_single_process_capture(pair):
    one = assert_same_statistics(pair["one"], pair["two"])
    assert len(one) == 2 * 4 * 4
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
