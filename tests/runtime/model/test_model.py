"""The whole H3 forward (runtime.model) against an independent implementation, comfy-kitchen's
norm + RoPE, quantized files, simulated devices, and ``verify --model``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from helpers import independent_h3 as ind
from helpers.h3files import quantize_file, read_tensors

from h3quant.cli import main
from h3quant.pipelines.metrics import error_metrics
from h3quant.runtime.model import H3Model
from h3quant.runtime.model.layout import PackedLayout
from h3quant.runtime.model.ops import RopeTable, qk_norm_rope, rope_angles

pytestmark = pytest.mark.slow  # whole-model / verify runs on module-wide files: the slow subset

SIGMA = 0.45


@pytest.fixture(scope="module")
def mfiles(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("model")
    out = {"dir": d}
    for form in ("pruned", "full"):
        bf16 = d / f"{form}.safetensors"
        synth_checkpoint(bf16, preset="tiny", blocks=2, form=form, seed=1)
        out[form] = bf16
    out["int8"] = quantize_file(out["pruned"], d / "int8.safetensors")
    # W4A8 on out_proj (the smallest linear: the test encoder is slow), int8 elsewhere
    out["w4a8"] = quantize_file(out["pruned"], d / "w4a8.safetensors",
                                fmt={"attn.out_proj": "w4a8"})
    return out


def _inputs(shape=(2, 4, 6), audio=3, text=5, width=768, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, 24, *shape, generator=g)
    a = torch.randn(1, 32, 2, audio, generator=g)
    t = torch.randn(1, text, width, generator=g)
    return v.to(dtype), a.to(dtype), t.to(dtype)


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# ------------------------------------------------------------------------------- oracles


def test_norm_and_rope_equal_comfy_kitchen_split_half():
    ck = pytest.importorskip("comfy_kitchen")
    lay = PackedLayout.t2va(7, 3, 4, 6, 5)
    inv = 10000.0 ** (-torch.arange(16, dtype=torch.float64) / 16)
    angles = rope_angles(lay.positions.float(), inv.float())
    assert angles.shape == (lay.rows, 48)
    rope = RopeTable.from_angles(angles, torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(lay.rows, 3, 128, generator=g) * 3 for _ in range(2))
    qw, kw = (1 + 0.1 * torch.randn(128, generator=g) for _ in range(2))
    ours = qk_norm_rope(q, k, qw, kw, rope)
    c, s = rope.cos[:, 0], rope.sin[:, 0]
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, lay.rows, 1, 48, 2, 2)
    theirs = ck.rms_rope_split_half(q[None], k[None], table, qw, kw, epsilon=1e-5, rot_dim=96)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[0][..., :96], F.rms_norm(q, (128,), qw, 1e-5)[..., :96])
    assert torch.equal(ours[0][..., 96:], F.rms_norm(q, (128,), qw, 1e-5)[..., 96:])


@pytest.mark.parametrize("form", ["pruned", "full"])
def test_float_model_equals_an_independent_implementation(mfiles, form):
    src, _ = read_tensors(mfiles[form])
    v, a, t = _inputs()
    with H3Model.open(mfiles[form]) as m:
        got = m(v, a, t, SIGMA)
    want = ind.forward(src, v, a, t, SIGMA)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert _rel(g, w) < 2e-5, _rel(g, w)  # fp32 rounding (measured ~1e-6)
    # the refiner, RoPE and the per-segment rows matter: other inputs give other outputs
    other = ind.forward(src, v, a, t, 0.9)
    assert _rel(got[0], other[0]) > 0.01


def test_text_at_hidden_width_skips_the_refiner_and_odd_sizes_are_padded(mfiles):
    src, _ = read_tensors(mfiles["pruned"])
    v, a, t = _inputs(shape=(1, 5, 7), width=512)
    with H3Model.open(mfiles["pruned"]) as m:
        got = m(v, a, t, SIGMA)
    padded = F.pad(v, (0, 1, 0, 1, 0, 0), mode="circular")
    want = ind.forward(src, padded, a, t, SIGMA)
    assert got[0].shape == v.shape
    assert _rel(got[0], want[0][..., :5, :7]) < 2e-5 and _rel(got[1], want[1]) < 2e-5


def test_hidden_states_per_block_and_depth(mfiles):
    src, _ = read_tensors(mfiles["pruned"])
    v, a, t = _inputs()
    seen, want = [], []
    with H3Model.open(mfiles["pruned"]) as m:
        m(v, a, t, SIGMA, depth=1, on_block=lambda i, x: seen.append((i, x.clone())))
    ind.forward(src, v, a, t, SIGMA, hidden_states=want)
    assert [i for i, _ in seen] == [0]
    assert _rel(seen[0][1], want[0]) < 2e-5


@pytest.mark.parametrize("fmt,limit", [("int8", 20.0), ("w4a8", 8.0)])
def test_quantized_files_stay_within_the_documented_sqnr(mfiles, fmt, limit):
    v, a, t = _inputs()
    with H3Model.open(mfiles["pruned"]) as f, H3Model.open(mfiles[fmt]) as q:
        ref, got = f(v, a, t, SIGMA), q(v, a, t, SIGMA)
    for g, r in zip(got, ref):
        _, sqnr, _ = error_metrics(g, r)
        assert limit <= sqnr < 80, sqnr  # quantized, yet close


def test_bad_inputs_are_clear_errors(mfiles):
    from h3quant.errors import VerifyError

    v, a, t = _inputs()
    with H3Model.open(mfiles["pruned"]) as m:
        with pytest.raises(VerifyError, match="video latent"):
            m(v[:, :3], a, t, SIGMA)
        with pytest.raises(VerifyError, match="audio latent"):
            m(v, a[:, :, :1], t, SIGMA)
        with pytest.raises(VerifyError, match="text states"):
            m(v, a, t[..., :100], SIGMA)
        with pytest.raises(VerifyError, match="sigma"):
            m(v, a, t, 1.5)


# ---------------------------------------------------------------------- simulated devices


def _sim_run(path, sim, kind):
    v, a, t = _inputs(dtype=torch.bfloat16)
    with H3Model.open(path, kind, probe=sim.probe) as m:
        out = m(v, a, t, SIGMA)
        assert all(o.device.type == kind for o in out)
        assert not sim.device.of_kind("to_cpu")  # nothing left the device during the forward
    return [o.float().cpu() for o in out]


def test_simulated_npu_runs_the_whole_model_on_the_npu(mfiles):
    from h3quant.testing.sim_npu import simulated_npu

    with simulated_npu() as sim:
        got = _sim_run(mfiles["int8"], sim, "npu")
        assert not sim.device.of_kind("cpu_fallback")  # aten::_int_mm never ran
        calls = sim.extras["module"].calls
    assert calls.count("npu_quant_matmul") == 2 * 4
    v, a, t = _inputs()
    with H3Model.open(mfiles["int8"]) as m:
        cpu = m(v, a, t, SIGMA)
    for g, c in zip(got, cpu):
        assert error_metrics(g, c)[1] > 20  # bf16 on the device vs fp32 on the CPU


def test_simulated_mps_dequantizes_on_the_device(mfiles):
    from h3quant.testing.simdevice import simulated_mps

    with simulated_mps() as sim:  # any aten::_int_mm on the device would raise
        got = _sim_run(mfiles["int8"], sim, "mps")
        assert not sim.device.saw("aten::_int_mm")
    v, a, t = _inputs()
    with H3Model.open(mfiles["int8"]) as m:
        cpu = m(v, a, t, SIGMA)
    for g, c in zip(got, cpu):
        assert error_metrics(g, c)[1] > 20


# ------------------------------------------------------------------------- verify --model


def _cli(*args):
    return CliRunner().invoke(main, ["verify", *map(str, args)])


SMALL = ("--frames", 1, "--height", 4, "--width", 4, "--audio-frames", 4, "--text-tokens", 6)


def test_cli_verify_model_passes_and_reports_drift(mfiles):
    r = _cli(mfiles["int8"], "--reference", mfiles["pruned"], "--model", *SMALL, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] and doc["final_layer_run"] and doc["reference"].endswith("pruned.safetensors")
    assert [d["block"] for d in doc["drift"]] == [0, 1]
    assert {o["name"] for o in doc["outputs"]} == {"hidden", "video", "audio"}
    assert all(o["sqnr_db"] >= 20 for o in doc["outputs"])
    assert doc["backends"] == {"torch-int8": 8}
    assert any("computed once" in n for n in doc["notes"])  # identical float refiner tensors


def test_cli_verify_model_depth_and_own_weights(mfiles):
    r = _cli(mfiles["w4a8"], "--model", "--depth", 1, *SMALL)
    assert r.exit_code == 0, r.output
    assert "final layer skipped" in r.stdout and "float math" in r.stdout
    assert "dequantized" in r.stdout.splitlines()[1]


def test_cli_verify_model_fails_on_wrong_scales(mfiles, tmp_path):
    def x4(layer, parts, w):
        if layer == "blocks.1.mlp.fc1":
            parts["weight_scale"] = parts["weight_scale"] * 4
        return parts

    bad = quantize_file(mfiles["pruned"], tmp_path / "x4.safetensors", mutate=x4)
    r = _cli(bad, "--reference", mfiles["pruned"], "--model", *SMALL)
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.stdout


def test_cli_verify_model_usage_errors(mfiles, monkeypatch):
    r = _cli(mfiles["int8"], "--model", "--blocks", 2)
    assert r.exit_code == 2 and "--blocks cannot be used with --model" in r.output
    r = _cli(mfiles["int8"], "--depth", 1)
    assert r.exit_code == 2 and "add --model" in r.output
    r = _cli(mfiles["int8"], "--model", "--depth", 3, *SMALL)
    assert r.exit_code == 2 and "depth must be in 1..2" in r.output
    r = _cli(mfiles["int8"], "--model", "--reference", mfiles["w4a8"], *SMALL)
    assert r.exit_code == 2 and "must be a float checkpoint" in r.output
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    r = _cli(mfiles["int8"], "--model", "--plot", mfiles["dir"] / "d.png", *SMALL)
    assert r.exit_code == 2 and "needs matplotlib" in r.output
    assert not (mfiles["dir"] / "d.png").exists()


def test_cli_verify_model_plot(mfiles, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "drift.png"
    r = _cli(mfiles["int8"], "--model", "--plot", png, *SMALL)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synth_writes_what_the_forward_reads(mfiles):
    src, _ = read_tensors(mfiles["pruned"])
    fn = src["token_refiner.final_norm.weight"].float()
    assert fn.shape == (512,) and abs(fn.mean().item() - 1) < 0.02  # an RMSNorm weight, ~1
    assert src["condition_proj.weight"].shape == (512, 768)  # tiny text width != hidden
    inv = src["rope.inv_freq"].double()
    assert torch.allclose(inv, 10000.0 ** (-torch.arange(16, dtype=torch.float64) / 16))
    table = src["adaln_t_table"]
    assert table.shape == (1025, 8) and table.std(0).min() > 0.1  # varies with t
    full, _ = read_tensors(mfiles["full"])
    assert full["time_embedder.proj_in.weight"].shape == (64, 256)


@pytest.mark.parametrize("target", ["fp8", "fp8-e5m2", "mxfp8", "nvfp4", "int4-convrot"])
def test_decoded_formats_run_the_whole_model_on_a_simulated_device(mfiles, target):
    """Layers the runtime decodes (every format without an int8 grid) are decoded on the
    device itself: no CPU-only table, Hadamard or buffer meets the device's tensors."""
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.testing.simdevice import simulated_mps

    path = mfiles["dir"] / f"decoded-{target}.safetensors"
    if not path.exists():
        convert(mfiles["pruned"], path, ConvertOptions(target=target))
    with simulated_mps() as sim:
        got = _sim_run(path, sim, "mps")
    # the CPU in the device's bf16: INT4 ConvRot quantizes the activations to int4 (ComfyUI's
    # eager path), and bf16 and fp32 activations round to different codes
    v, a, t = _inputs(dtype=torch.bfloat16)
    with H3Model.open(path) as m:
        cpu = [o.float() for o in m(v, a, t, SIGMA)]
    for g, c in zip(got, cpu):
        assert error_metrics(g, c)[1] > 20  # the same bf16 math on the device and the CPU
