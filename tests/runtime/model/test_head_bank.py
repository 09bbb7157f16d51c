"""A bank of output heads (few-step checkpoints): per sampler step, the forward equals an
independent implementation of the reference rule written here; files without a bank are
unchanged; synth writes a bank, inspect / validate report it, ``verify --model --steps`` checks
every step."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from helpers import independent_h3 as ind
from helpers.h3files import quantize_file, read_tensors

from h3quant.cli import main
from h3quant.errors import VerifyError
from h3quant.runtime.model import H3Model
from h3quant.runtime.model.schedule import shifted_schedule

pytestmark = pytest.mark.slow  # whole-model / verify runs on module-wide files: the slow subset

N_HEADS = 4
PV, PA = 96, 32


# ------------------------------------------------------------------ the rule, written here

def t_schedule(steps, shift=12.0):
    """ComfyUI's "simple" scheduler of a discrete flow model (comfy/samplers.py,
    comfy/model_sampling.py), written out: a 1000-entry fp32 table of shifted sigmas read at
    ``-(1 + int(x * 1000 / steps))``, then 0."""
    ts = (torch.arange(1, 1001, 1) / 1000) * 1000
    ts = ts / 1000
    table = shift * ts / (1 + (shift - 1) * ts)
    step = len(table) / steps
    return [float(table[-(1 + int(x * step))]) for x in range(steps)] + [0.0]


def t_span(n, sigma, sigmas):
    """(start, stop) of the heads the step at ``sigma`` uses, as ComfyUI's FinalLayer computes
    them: the model's sigma a Python float (fp32 timestep / 1000), the schedule an fp32 tensor,
    the start's position in float64, the stop's in fp32, Python's round."""
    timestep = torch.FloatTensor([sigma]) * 1000
    sig = float((timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
    sched = torch.FloatTensor(sigmas)
    best = int((sched - sig).abs().argmin())
    nxt = sched[min(best + 1, sched.shape[0] - 1)]

    def grid_pos(s):  # float64 for a Python float, fp32 for a tensor
        base = s / (12.0 + s * (1.0 - 12.0))
        unshifted = 1.0 * base / (1.0 + (1.0 - 1.0) * base)
        return round(float(1.0 - unshifted) * n)

    start = min(grid_pos(sig), n - 1)
    stop = max(grid_pos(nxt), start + 1)
    return start, stop


def t_head(weight, bias, n, width, start, stop, shift):
    """Head 0 plus the offsets ``start..stop-1`` (head 0 excluded) weighted by their share of
    the step's span on the shifted grid."""
    edges = [1.0 - j / n for j in range(n + 1)]
    t = [1.0 - shift * g / (1.0 + (shift - 1.0) * g) for g in edges]
    dts = [t[j + 1] - t[j] for j in range(start, stop)]
    total = sum(dts)
    w = weight.double().reshape(n, width, -1)
    b = bias.double().reshape(n, width)
    hw, hb = w[0].clone(), b[0].clone()
    for j in range(max(start, 1), stop):
        share = dts[j - start] / total
        hw += share * w[j]
        hb += share * b[j]
    return hw.float(), hb.float()


# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def bank_files(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("bank")
    bank = d / "bank.safetensors"
    synth_checkpoint(bank, preset="tiny", blocks=2, form="pruned", seed=4, head_bank=N_HEADS)
    plain = d / "plain.safetensors"
    synth_checkpoint(plain, preset="tiny", blocks=2, form="pruned", seed=4)
    return {"dir": d, "bank": bank, "plain": plain,
            "int8": quantize_file(bank, d / "bank_int8.safetensors")}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 3, generator=g),
            torch.randn(1, 5, 768, generator=g))


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# ------------------------------------------------------------------------------------ tests

def test_schedule_and_spans_follow_the_rule():
    sched = shifted_schedule(8)
    assert sched == pytest.approx(t_schedule(8), abs=0, rel=0)
    spans = [t_span(N_HEADS, s, sched) for s in sched[:-1]]
    # 6 of the 8 steps use more than head 0 alone
    assert sum(sp != (0, 1) for sp in spans) == 6, spans
    from h3quant.runtime.model.schedule import head_span
    for i, s in enumerate(sched[:-1]):
        hs = head_span(N_HEADS, s, sched)
        assert (hs.step, hs.start, hs.stop) == (i, *spans[i])
    # a span over several heads (a coarse schedule): the weights differ from a plain mean
    coarse = [1.0, 0.5, 0.0]
    assert t_span(N_HEADS, 1.0, coarse)[1] - t_span(N_HEADS, 1.0, coarse)[0] > 1


@pytest.mark.parametrize("steps", [8, 2])
def test_every_step_equals_the_independent_rule(bank_files, steps):
    src, _ = read_tensors(bank_files["bank"])
    v, a, t = _inputs()
    sched = t_schedule(steps)
    vw, vb = src["final_layer.video_out.weight"], src["final_layer.video_out.bias"]
    aw, ab = src["final_layer.audio_out.weight"], src["final_layer.audio_out.bias"]
    assert vw.shape[0] == N_HEADS * PV and aw.shape[0] == N_HEADS * PA
    seen = set()
    with H3Model.open(bank_files["bank"]) as m:
        assert m.head_bank == N_HEADS
        for i in range(steps):
            start, stop = t_span(N_HEADS, sched[i], sched)
            seen.add((start, stop))
            one = dict(src)
            one["final_layer.video_out.weight"], one["final_layer.video_out.bias"] = \
                t_head(vw, vb, N_HEADS, PV, start, stop, 12.0)
            one["final_layer.audio_out.weight"], one["final_layer.audio_out.bias"] = \
                t_head(aw, ab, N_HEADS, PA, start, stop, 3.0)
            want = ind.forward(one, v, a, t, sched[i])
            got = m(v, a, t, sigmas=sched, step=i)
            for g, w in zip(got, want):
                assert _rel(g, w) < 2e-5, (i, _rel(g, w))
            if (start, stop) != (0, 1):  # head 0 alone would be visibly wrong
                head0 = dict(src)
                head0["final_layer.audio_out.weight"] = aw[:PA]
                head0["final_layer.audio_out.bias"] = ab[:PA]
                wrong = ind.forward(head0, v, a, t, sched[i])
                assert _rel(got[0], wrong[0]) > 0.05 and _rel(got[1], wrong[1]) > 0.05
    assert len(seen) > 1


@pytest.mark.parametrize("heads,steps", [(4, 8), (4, 16)])
def test_the_tie_at_sigma_0878_picks_the_head_comfyui_picks(heads, steps):
    """At sigma ~0.878 the head position is 2.5 up to float64 rounding: ComfyUI computes it
    in float64 from the Python float sigma (2.5000000254... -> head 3); in fp32 it lands on
    2.5 and rounds to even (head 2). Every step of the schedule must agree with ComfyUI."""
    from h3quant.runtime.model.schedule import head_span

    sched = t_schedule(steps)
    assert shifted_schedule(steps) == sched  # bit for bit, every entry
    tie = [i for i, s in enumerate(sched[:-1]) if abs(s - 0.878049) < 1e-6]
    assert len(tie) == 1
    for i, s in enumerate(sched[:-1]):
        hs = head_span(heads, s, sched)
        assert (hs.step, hs.start, hs.stop) == (i, *t_span(heads, s, sched)), (i, s)
    assert t_span(heads, sched[tie[0]], sched)[0] == 3
    # the same position in fp32 (the arithmetic ComfyUI does not use) would pick head 2
    s32 = torch.tensor(sched[tie[0]], dtype=torch.float32)
    assert round(float(1.0 - s32 / (12.0 + s32 * (1.0 - 12.0))) * heads) == 2


@pytest.mark.slow
def test_a_bank_needs_the_schedule_and_a_plain_file_ignores_it(bank_files):
    v, a, t = _inputs(1)
    sched = shifted_schedule(4)
    with H3Model.open(bank_files["bank"]) as m:
        with pytest.raises(VerifyError, match="bank of 4 heads.*schedule"):
            m(v, a, t, 0.5)
        with pytest.raises(VerifyError, match="step must be in 0..3"):
            m(v, a, t, sigmas=sched, step=4)
        with pytest.raises(VerifyError, match="is not sigmas"):
            m(v, a, t, 0.5, sigmas=sched, step=1)
    with H3Model.open(bank_files["plain"]) as m:
        assert m.head_bank == 1
        for i in (0, 2):
            assert all(torch.equal(x, y) for x, y in zip(m(v, a, t, sigmas=sched, step=i),
                                                        m(v, a, t, sched[i])))


def test_synth_inspect_and_validate_report_the_bank(bank_files, tmp_path):
    out = tmp_path / "b3.safetensors"
    r = CliRunner().invoke(main, ["synth", str(out), "--head-bank", "3", "-q"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["topology"]["head_bank"] == 3
    r = CliRunner().invoke(main, ["inspect", str(bank_files["bank"])])
    assert "head_bank=4" in r.stdout
    r = CliRunner().invoke(main, ["inspect", str(bank_files["plain"]), "--json"])
    assert json.loads(r.stdout)["topology"]["head_bank"] == 1
    r = CliRunner().invoke(main, ["validate", str(out)])
    assert r.exit_code == 0, r.output
    # video and audio stacking different numbers of heads: a topology error
    from h3quant.formats.container.writer import save_tensors
    src, meta = read_tensors(out)
    src["final_layer.audio_out.weight"] = src["final_layer.audio_out.weight"][:2 * PA]
    bad = tmp_path / "bad.safetensors"
    save_tensors(bad, src, meta)
    r = CliRunner().invoke(main, ["validate", str(bad)])
    assert r.exit_code != 0 and "T102" in r.output and "audio_out" in r.output
    r = CliRunner().invoke(main, ["synth", str(tmp_path / "x.safetensors"), "--head-bank", "0"])
    assert r.exit_code == 2


def test_verify_model_checks_every_step(bank_files):
    small = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "4",
             "--text-tokens", "8"]
    f = str(bank_files["int8"])
    r = CliRunner().invoke(main, ["verify", f, "--model", "--steps", "8", "--json", *small])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["head_bank"] == N_HEADS and len(res["steps"]) == 8
    sched = t_schedule(8)
    assert [tuple(s["heads"]) for s in res["steps"]] == [t_span(N_HEADS, s, sched)
                                                         for s in sched[:-1]]
    assert {o["name"] for o in res["outputs"]} >= {f"video (step {i})" for i in range(8)}
    r = CliRunner().invoke(main, ["verify", f, "--model", "--sigmas", "1,0.8,0.3,0", *small])
    assert r.exit_code == 0, r.output
    assert "heads" in r.stdout and "step   2" in r.stdout
    # without a schedule: a clear error naming the options
    r = CliRunner().invoke(main, ["verify", f, "--model", *small])
    assert r.exit_code == 2 and "--steps" in r.output
    for bad, msg in ((["--steps", "4", "--sigmas", "1,0"], "together"),
                     (["--sigmas", "0.5,0.9,0"], "must not increase"),
                     (["--sigmas", "1,x"], "numbers"),
                     (["--steps", "4", "--sigma", "0.5"], "--sigma cannot")):
        r = CliRunner().invoke(main, ["verify", f, "--model", *bad, *small])
        assert r.exit_code == 2 and msg in r.output, (bad, r.output)
    r = CliRunner().invoke(main, ["verify", f, "--steps", "4"])
    assert r.exit_code == 2 and "--steps" in r.output
