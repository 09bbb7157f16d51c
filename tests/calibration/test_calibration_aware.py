"""Activation-aware error feedback: inputs that are not rounded give the plain feedback's bytes;
with coarse activation rounding the objective |X W^T - Xq Wq^T|^2, computed here from the
rows themselves, is lower than activation-unaware feedback leaves it (exact statistics, and the
statistics file's model from sampled rows through a codec and its runtime rounding)."""

import math

import pytest
import torch

from h3quant.calibration.aware import gains_and_noise, input_rounding
from h3quant.calibration.gptq import aware_target, feedback, inverse_factor
from h3quant.calibration.stats import LayerStats
from h3quant.formats import registry


def _rows(m, k, seed=0):
    """Rows with a few outlier channels (as trained activations have) and shared structure."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 16, generator=g) @ torch.randn(16, k, generator=g) * 0.3
    x += torch.randn(m, k, generator=g)
    x[:, :: k // 4] *= 12.0
    return x


def _round_per_token(x, qmax):
    """Symmetric per-row rounding to ``[-qmax, qmax]`` (written here, independent of h3quant)."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / qmax
    return (x / s).round().clamp(-qmax, qmax) * s


def _weight(n, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g)


def _rtn_int4(w):
    """Per-row int4 levels of ``w``: (``quantize(v, j)`` for feedback, the scales)."""
    s = w.abs().amax(1) / 7

    def quantize(v, j):
        c = (v / s).round().clamp(-7, 7)
        return c, c * s
    return quantize, s


def _objective(x, xq, w, w_hat):
    return float(((x.double() @ w.double().t() - xq.double() @ w_hat.double().t()) ** 2).sum())


def test_aware_target_of_unrounded_inputs_is_the_weight_itself():
    x = _rows(512, 32)
    h = x.t() @ x
    w = _weight(8, 32)
    assert aware_target(w, h, h.clone()) is w


def test_gains_and_noise_of_a_known_rounding():
    x = _rows(256, 32)
    a, v = gains_and_noise(x, x, (x * x).sum(0))
    assert torch.equal(a, torch.ones(32, dtype=torch.float64)) and not bool(v.any())
    a, v = gains_and_noise(x, 0.5 * x, (x * x).sum(0))
    assert torch.allclose(a, torch.full((32,), 0.5, dtype=torch.float64))
    assert float(v.abs().max()) < 1e-9
    zero = x.clone()
    zero[:, 3] = 0  # a channel the sample never sees keeps gain 1, no noise
    a, v = gains_and_noise(zero, zero, (x * x).sum(0))
    assert float(a[3]) == 1.0 and float(v[3]) == 0.0


def test_exact_statistics_lower_the_objective_under_coarse_rounding():
    """The closed form with the exact C = X^T Xq and Hq = Xq^T Xq against the plain feedback
    (H = X^T X), the objective measured on the very rows (3-level-a-side rounding per token)."""
    k, n = 64, 48
    x = _rows(4096, k)
    xq = _round_per_token(x, 3)
    w = _weight(n, k)
    quantize, _ = _rtn_int4(w)
    h, c, hq = x.t() @ x, x.t() @ xq, xq.t() @ xq
    plain = feedback(w, inverse_factor(h), quantize)
    aware = feedback(aware_target(w, c, hq), inverse_factor(hq), quantize)
    _, s = _rtn_int4(w)
    e_plain = _objective(x, xq, w, plain * s[:, None])
    e_aware = _objective(x, xq, w, aware * s[:, None])
    rtn = _objective(x, xq, w, (w / s[:, None]).round().clamp(-7, 7) * s[:, None])
    assert e_plain < rtn
    assert 10 * math.log10(e_plain / e_aware) > 0.5, (e_plain, e_aware)


def _hadamard_rotation(k, g):
    """ConvRot's rotation of ``K`` inputs as comfy-kitchen builds it: ``x @ R``, one regular
    Hadamard ``H_g^T`` per block of ``g``."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    hg = _build_hadamard(g).to(torch.float64).t()
    return torch.block_diag(*[hg] * (k // g))


def _stats(x, sample_rows=256):
    pick = torch.linspace(0, x.shape[0] - 1, sample_rows).round().long()
    sample = x[pick].clone()
    return LayerStats(key="blocks.0.mlp.fc1", k=x.shape[1], rows=x.shape[0], _load=None,
                      absmean=x.abs().mean(0), _h=x.t() @ x, _load_sample=lambda: sample)


def test_codec_with_runtime_rounding_lowers_the_objective():
    """Through INT4 ConvRot's calibrated encoder: plain statistics, then the same with the
    runtime's int4 input rounding (modelled from 256 sampled rows); the objective is measured
    here on every calibration row, with comfy-kitchen's rotation and per-token int4 rounding
    written in the test. (On held-out rows of this synthetic distribution the gain is mostly
    gone: the rounding's deterministic part is small after the rotation.)"""
    k, n, g = 256, 64, 64
    x = _rows(8192, k, seed=2)
    w = _weight(n, k, seed=4)
    codec = registry.target_codec("int4-convrot")
    marker = codec.spec.planning.marker(registry.target("int4-convrot"), g)
    st = _stats(x)
    plain = codec.encoder.encode(w, marker, "exact", calibration=st)
    rounding = input_rounding(codec, marker)
    assert rounding is not None
    aware = codec.encoder.encode(w, marker, "exact", calibration=st.rounded_by(rounding))
    r = _hadamard_rotation(k, g)
    xr = x.double() @ r
    xq = _round_per_token(xr, 7)
    wr = w.double() @ r

    def objective(tensors):
        w_hat, _ = codec.encoder.report_grid(tensors, marker)
        return _objective(xr, xq, wr, w_hat.double() @ r)

    gain = 10 * math.log10(objective(plain) / objective(aware))
    assert gain > 0.15, gain


@pytest.mark.parametrize("target", ["int8-convrot", "int8", "w4a8", "int4-convrot"])
def test_unrounded_inputs_give_the_plain_feedback_bytes(target):
    k, n, g = 256, 32, 64
    x = _rows(2048, k)
    w = _weight(n, k)
    codec = registry.target_codec(target)
    marker = codec.spec.planning.marker(registry.target(target), g)
    st = _stats(x)
    plain = codec.encoder.encode(w, marker, "exact", calibration=st)
    ident = codec.encoder.encode(w, marker, "exact", calibration=st.rounded_by(lambda s: (s, s.clone())))
    assert plain.keys() == ident.keys()
    for name in plain:
        assert torch.equal(plain[name], ident[name]), name
    rounding = input_rounding(codec, marker)
    assert rounding is not None
    changed = codec.encoder.encode(w, marker, "exact", calibration=st.rounded_by(rounding))
    assert not torch.equal(plain["weight"], changed["weight"])  # the rounding is seen


def test_float_activation_formats_and_version_1_statistics_keep_the_plain_feedback():
    codec = registry.target_codec("nvfp4")
    assert input_rounding(codec, codec.spec.planning.marker(registry.target("nvfp4"), 256)) is None
    x = _rows(2048, 256)
    st = LayerStats.from_hessian("blocks.0.mlp.fc1", x.t() @ x, 2048)  # no sampled rows
    codec = registry.target_codec("w4a8")
    marker = codec.spec.planning.marker(registry.target("w4a8"), 64)
    w = _weight(32, 256)
    aware = st.rounded_by(input_rounding(codec, marker))
    assert aware.aware_system(True, 64) is None
    a = codec.encoder.encode(w, marker, "exact", calibration=st)
    b = codec.encoder.encode(w, marker, "exact", calibration=aware)
    assert all(torch.equal(a[t], b[t]) for t in a)


# ------------------------------------------------------------------------- convert end to end

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.synth import synth_checkpoint

    from helpers.inputs import input_dims, seeded_inputs

    d = tmp_path_factory.mktemp("aware")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=3)
    ins = seeded_inputs(d, input_dims(src), range(5))
    stats = d / "a.stats"
    capture_statistics(src, ins, stats, predict=False)
    return {"d": d, "src": src, "stats": stats}


def _convert(world, target, aware, name):
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.pipelines.convert import ConvertOptions, convert

    out = world["d"] / name
    rep = convert(world["src"], out, ConvertOptions(
        target=target, overwrite=True, calibration=str(world["stats"]),
        activation_aware=aware)).to_dict()
    layers = rep["layers"] if isinstance(rep["layers"], list) else list(rep["layers"].values())
    with Checkpoint(out) as c:
        tensors = {n: c.read(n) for n in c.tensors}
    return [lay.get("calibration", {}) for lay in layers], tensors


@pytest.mark.parametrize("target", ["int4-convrot", "w4a8"])
def test_convert_activation_aware_changes_codes_not_the_format(world, target):
    cal_off, off = _convert(world, target, "off", f"off_{target}.safetensors")
    cal_on, on = _convert(world, target, "auto", f"on_{target}.safetensors")
    assert all("activation_aware" not in c for c in cal_off)
    assert [c.get("activation_aware") for c in cal_on if "basis" in c] == ["on"] * 4
    assert off.keys() == on.keys()
    assert all(off[n].dtype == on[n].dtype and off[n].shape == on[n].shape for n in off)
    def raw(t):
        return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t

    changed = [n for n in off if not torch.equal(raw(off[n]), raw(on[n]))]
    # the codes move; W4A8's calibrated encode also picks each group's scale from the weights
    # the feedback has updated, so its per-group scales may move with them
    moving = (".weight", ".weight_s_rel") if target == "w4a8" else (".weight",)
    assert changed and all(n.endswith(moving) for n in changed), changed
    assert any(n.endswith(".weight") for n in changed), changed


def test_convert_activation_aware_leaves_float_activation_formats_alone(world):
    cal, _ = _convert(world, "nvfp4", "auto", "nvfp4.safetensors")
    notes = {c.get("activation_aware") for c in cal if "basis" in c}
    assert notes == {"off: the runtime keeps this format's activations in float"}


def test_activation_aware_needs_calibration():
    from h3quant.errors import ConvertError
    from h3quant.pipelines.convert import ConvertOptions

    with pytest.raises(ConvertError, match="--activation-aware auto needs --calibration"):
        ConvertOptions(target="int4-convrot", activation_aware="auto")
