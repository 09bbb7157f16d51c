"""Hostile statistics are refused, never a crash: a file whose Hessian is not symmetric, not a
sum ``X^T X``, non-finite, or missing, or whose mean ``|x|`` is NaN or negative, gets one
verdict (exit 2 naming the file, the tensor and the rule) from convert with every calibrated
format and from plan, before any layer uses it. The statistics are written here (valid ones
from random activations ``X^T X``, then edited)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from h3quant.calibration.stats import Statistics, hessian_violation
from h3quant.cli import main
from h3quant.errors import UsageError
from h3quant.synth import synth_checkpoint

L = "blocks.0.mlp.fc1"
CALIBRATED = ["int8", "int8-convrot", "w4a8", "nvfp4", "int4-convrot", "awq-w4a16"]


def _gram(k, seed):
    x = torch.randn(4 * k, k, generator=torch.Generator().manual_seed(seed))
    return (x.t() @ x).float(), x.abs().mean(0).float(), 4 * k


def _write(path, src, layers: dict, skip: str | None = None):
    """``layers``: key -> (H, absmean, rows); ``skip``: a tensor name left out of the file."""
    from safetensors.torch import save_file

    from h3quant.calibration.fingerprint import checkpoint_fingerprint

    meta = {"version": 1, "checkpoint": checkpoint_fingerprint(src), "blocks": 1, "inputs": [],
            "rows": {k: v[2] for k, v in layers.items()}, "forward": "float"}
    tensors = {}
    for k, (h, am, _) in layers.items():
        tensors[f"{k}.hessian"], tensors[f"{k}.absmean"] = h.contiguous(), am.contiguous()
    tensors.pop(skip, None)
    save_file(tensors, str(path), metadata={"h3quant.calibration": json.dumps(meta)})
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("stats")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=3, workers=1)
    from safetensors import safe_open

    from h3quant.calibration.stats import LINEARS

    with safe_open(str(src), "pt") as f:
        widths = {f"blocks.0.{lin}": f.get_slice(f"blocks.0.{lin}.weight").get_shape()[1]
                  for lin in LINEARS}
    layers = {k: _gram(n, i) for i, (k, n) in enumerate(sorted(widths.items()))}
    good = _write(d / "good.stats", src, layers)
    return {"d": d, "src": src, "layers": layers, "good": good}


def _edited(world, name, fn):
    layers = {k: (h.clone(), am.clone(), r) for k, (h, am, r) in world["layers"].items()}
    fn(layers)
    return _write(world["d"] / f"{name}.stats", world["src"], layers)


def _asym(ls):
    h = ls[L][0]
    h[3, 5] += 0.5 * float(h.diagonal().max())


def _not_gram(ls):  # symmetric, yet |H_ij| > sqrt(H_ii H_jj): no X gives it
    h = ls[L][0]
    v = 3.0 * float((h[2, 2] * h[9, 9]).sqrt())
    h[2, 9] = h[9, 2] = v


def _neg_diag(ls):
    ls[L][0][4, 4] = -1.0


def _nan_h(ls):
    ls[L][0][1, 1] = float("nan")


def _nan_mean(ls):
    ls[L][1][7] = float("nan")


def _neg_mean(ls):
    ls[L][1][7] = -0.25


HOSTILE = {"asymmetric H": (_asym, "not symmetric"), "not X^T X": (_not_gram, "not a sum"),
           "negative diagonal": (_neg_diag, "sum of squares"),
           "NaN in H": (_nan_h, "non-finite"), "NaN mean": (_nan_mean, "non-finite"),
           "negative mean": (_neg_mean, "negative")}


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    assert res.exit_code != 3, res.output
    return res


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_statistics_get_one_verdict(world, tmp_path, name):
    fn, words = HOSTILE[name]
    stats = _edited(world, name.replace(" ", "-").replace("^", ""), fn)
    with pytest.raises(UsageError, match=words) as e:
        Statistics(stats)
    assert e.value.tensor.startswith(L + ".")
    verdicts = {}
    for to in CALIBRATED:
        o = tmp_path / f"{to}.safetensors"
        res = run("convert", world["src"], o, "--to", to, "--calibration", stats, "--no-report",
                  "-q")
        verdicts[to] = (res.exit_code, words in res.output and str(stats) in res.output)
        assert not o.exists()
    res = run("plan", world["src"], "--formats", "int8", "--calibration", stats,
              "--target-sqnr", "20", "-q")
    verdicts["plan"] = (res.exit_code, words in res.output)
    assert set(verdicts.values()) == {(2, True)}, verdicts
    v = run("validate", stats, "--json")  # the same rule, as a finding
    doc = json.loads(v.stdout)
    assert v.exit_code == 1 and [f["code"] for f in doc["findings"]] == ["K101"], doc
    assert words in doc["findings"][0]["message"] and doc["findings"][0]["tensor"].startswith(L)


def test_a_missing_hessian_is_named_as_the_hessian(world):
    stats = _write(world["d"] / "no-h.stats", world["src"], world["layers"],
                   skip=f"{L}.hessian")
    with pytest.raises(UsageError, match=r"\.hessian is missing") as e:
        Statistics(stats)
    assert e.value.tensor == f"{L}.hessian"


def test_valid_statistics_pass_every_format(world, tmp_path):
    with Statistics(world["good"]):
        pass
    v = run("validate", world["good"])
    assert v.exit_code == 0 and "statistics" in v.output, v.output
    for to in ("w4a8", "nvfp4"):
        res = run("convert", world["src"], tmp_path / f"{to}.safetensors", "--to", to,
                  "--calibration", world["good"], "--no-report", "-q")
        assert res.exit_code == 0, (to, res.output)


@pytest.mark.parametrize("k", [1, 7, 64])
def test_the_hessian_rule_accepts_every_gram_matrix_and_refuses_a_tilt(k):
    h, _, _ = _gram(k, k)
    assert hessian_violation(h) is None
    assert hessian_violation(torch.zeros(k, k)) is None  # a dead layer: all zero inputs
    if k > 1:
        t = h.clone()
        t[0, k - 1] += 0.01 * float(h.diagonal().max())
        assert "not symmetric" in hessian_violation(t)


def _write_v2(path, src, layers: dict, edit=None):
    """A version 2 file (channel maxima and 4 sampled rows per layer); ``edit(tensors)`` first."""
    from safetensors.torch import save_file

    from h3quant.calibration.fingerprint import checkpoint_fingerprint

    meta = {"version": 2, "checkpoint": checkpoint_fingerprint(src), "blocks": 1, "inputs": [],
            "rows": {k: v[2] for k, v in layers.items()}, "forward": "float", "sample_rows": 4}
    tensors = {}
    for k, (h, am, _) in layers.items():
        tensors[f"{k}.hessian"], tensors[f"{k}.absmean"] = h.contiguous(), am.contiguous()
        tensors[f"{k}.absmax"] = (3 * am).contiguous()
        tensors[f"{k}.sample"] = torch.ones(4, am.numel())
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(path), metadata={"h3quant.calibration": json.dumps(meta)})
    return path


@pytest.mark.parametrize("part, value, words", [("absmax", -1.0, "negative"),
                                                ("absmax", float("nan"), "non-finite"),
                                                ("sample", float("inf"), "non-finite")])
def test_version_2_channel_maxima_and_sampled_rows_are_checked_too(world, part, value, words):
    good = _write_v2(world["d"] / "v2.stats", world["src"], world["layers"])
    with Statistics(good):
        pass

    def edit(tensors):
        tensors[f"{L}.{part}"].view(-1)[3] = value

    bad = _write_v2(world["d"] / f"v2-{part}.stats", world["src"], world["layers"], edit)
    with pytest.raises(UsageError, match=words) as e:
        Statistics(bad)
    assert e.value.tensor == f"{L}.{part}"
    v = run("validate", bad, "--json")
    doc = json.loads(v.stdout)
    assert v.exit_code == 1 and [f["code"] for f in doc["findings"]] == ["K101"], doc
