"""Calibration: error feedback against an independent GPTQ, identity statistics reproduce
round-to-nearest bit for bit (every calibrated format, codec and whole convert), the guards
(another checkpoint, too few rows), capture against a forward hook, comfy-kitchen reading
calibrated files."""

import json

import pytest
import torch
from click.testing import CliRunner

from h3quant.calibration.gptq import feedback, inverse_factor, output_sqnr_db, predicted_gain_db
from h3quant.calibration.stats import LayerStats, Statistics, layer_key
from h3quant.cli import main
from h3quant.formats import registry
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.synth import synth_checkpoint

from helpers.inputs import input_dims, seeded_inputs

TARGETS = [("int8-convrot", 64), ("int8-convrot", 256), ("int8", 256), ("w4a8", 256),
           ("nvfp4", 256), ("int4-convrot", 64), ("int4-convrot", 256)]


def _lowrank_h(k, rows=4096, rank=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, rank, generator=g) @ torch.randn(rank, k, generator=g)
    x += 0.05 * torch.randn(rows, k, generator=g)
    return x.t() @ x


def _weights(n, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * (1 + 3 * (torch.rand(k, generator=g) < 0.02))


def _raw(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _encode(target, g, w, calibration=None):
    codec = registry.target_codec(target)
    marker = codec.spec.planning.marker(registry.target(target), g)
    kw = {} if calibration is None else {"calibration": calibration}
    return codec, marker, codec.encoder.encode(w, marker, "exact", **kw)


# ------------------------------------------------------------------------- the algorithm

def _reference_gptq(w, h, s, damp=0.01, lazy_group=0):
    """GPTQ written out directly (float64, one column at a time, explicit inverse update):
    round column j, push its error onto later columns with row j of the running inverse
    Hessian, then remove column j from the inverse (the OBS update). ``lazy_group``: when
    column j starts a group of that many, the group's scale becomes its current (already
    updated) abs-max over 7 per row and codes are clamped to +-7 (``s`` is then unused)."""
    h = h.double().clone()
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    w = w.double().clone()
    s = None if s is None else s.double()
    top = 7 if lazy_group else 127
    q = torch.zeros_like(w)
    for j in range(w.shape[1]):
        if lazy_group and j % lazy_group == 0:
            s = w[:, j:j + lazy_group].abs().amax(1) / 7.0
        c = (w[:, j] / s).round().clamp(-top, top)
        q[:, j] = c
        err = (w[:, j] - c * s) / hinv[j, j]
        w[:, j + 1:] -= err[:, None] * hinv[j, j + 1:][None, :]
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q


def test_feedback_matches_a_direct_gptq():
    k, n = 96, 40
    h = _lowrank_h(k, rank=12)
    w = _weights(n, k)
    s = w.abs().amax(1) / 127.0

    def quantize(v, j):
        c = (v / s).round().clamp(-127, 127)
        return c, c * s

    got = feedback(w, inverse_factor(h), quantize, block=32)  # several blocks
    want = _reference_gptq(w, h, s)
    assert (got.double() == want).double().mean() > 0.99
    rtn = (w / s[:, None]).round()
    e_rtn = output_sqnr_db(w, rtn * s[:, None], h)
    e_got = output_sqnr_db(w, got * s[:, None], h)
    assert e_got > e_rtn + 3.0  # the low-rank inputs make feedback pay


def test_feedback_group_hook_sees_the_updated_columns():
    """``groups``: the hook runs at each group's first column with the columns as updated so
    far (the lazy scales it sets then match a direct lazy GPTQ) and the factor's group block."""
    k, n, g = 96, 40, 16
    h = _lowrank_h(k, rank=12)
    w = _weights(n, k)
    u_full = inverse_factor(h)
    state = {}

    def start(cols, j, u):
        assert cols.shape == (g, n) and torch.equal(u, u_full[j:j + g, j:j + g])
        state["s"] = cols.abs().amax(0) / 7.0

    def quantize(v, j):
        c = (v / state["s"]).round().clamp(-7, 7)
        return c, c * state["s"]

    got = feedback(w, u_full, quantize, block=32, groups=(g, start))
    want = _reference_gptq(w, h, None, lazy_group=g)
    assert (got.double() == want).double().mean() > 0.99
    static = feedback(w, u_full, lambda v, j: quantize(v, j), block=32)  # last group's scales
    assert not torch.equal(static, got)
    with pytest.raises(ValueError, match="divide"):
        feedback(w, u_full, quantize, block=32, groups=(12, start))


def test_predicted_gain_tracks_the_spectrum():
    k = 64
    assert abs(predicted_gain_db(torch.eye(k) * 5.0)) < 1e-5  # nothing to gain from white inputs
    assert predicted_gain_db(_lowrank_h(k, rank=4)) > 10.0


@pytest.mark.parametrize("target, g", TARGETS)
def test_identity_statistics_give_round_to_nearest_bytes(target, g):
    w = _weights(48, 512, seed=3)
    _, _, rtn = _encode(target, g, w)
    ident = LayerStats.from_hessian("blocks.0.mlp.fc1", torch.eye(512) * 7.0, 10_000)
    _, _, cal = _encode(target, g, w, ident)
    assert set(cal) == set(rtn)
    for key in rtn:
        assert torch.equal(_raw(cal[key]), _raw(rtn[key])), key


@pytest.mark.parametrize("target, g", [("nvfp4", 256), ("int4-convrot", 256)])
def test_identity_statistics_bf16_and_padding(target, g):
    """The 4-bit encoders compute in the weight's dtype: a bf16 weight (and, for nvfp4, rows
    and columns that need padding) still gives the round-to-nearest bytes."""
    k = 512 if target == "int4-convrot" else 200
    w = _weights(37, k, seed=6).to(torch.bfloat16)
    _, _, rtn = _encode(target, g, w)
    _, _, cal = _encode(target, g, w, LayerStats.from_hessian("blocks.0.mlp.fc1",
                                                              torch.eye(k) * 2.0, 10_000))
    for key in rtn:
        assert torch.equal(_raw(cal[key]), _raw(rtn[key])), key


@pytest.mark.parametrize("target, g", TARGETS)
def test_calibrated_codes_lower_the_output_error(target, g):
    w = _weights(48, 512, seed=4)
    h = _lowrank_h(512, rank=32, seed=5)
    codec, marker, rtn = _encode(target, g, w)
    _, _, cal = _encode(target, g, w, LayerStats.from_hessian("blocks.0.mlp.fc1", h, 4096))
    # same scales (and codebook): only the codes moved (W4A8 and nvfp4 choose their group
    # scales during the feedback: tests/formats/{w4a8,nvfp4}/test_*_calibrated.py)
    lazy = {("w4a8", "weight_s_rel"), ("nvfp4", "weight_scale")}
    for key in rtn:
        if key != "weight" and (target, key) not in lazy:
            assert torch.equal(_raw(cal[key]), _raw(rtn[key])), key
    w_rtn, _ = codec.encoder.report_grid(rtn, marker)
    w_cal, _ = codec.encoder.report_grid(cal, marker)
    assert output_sqnr_db(w, w_cal, h) > output_sqnr_db(w, w_rtn, h) + 3.0
    assert output_sqnr_db(w, w_cal, torch.eye(512)) < output_sqnr_db(w, w_rtn, torch.eye(512))


def test_layer_key_skips_the_token_refiner():
    assert layer_key("model.diffusion_model.blocks.3.mlp.fc2") == "blocks.3.mlp.fc2"
    assert layer_key("blocks.0.attn.qkv_proj") == "blocks.0.attn.qkv_proj"
    assert layer_key("token_refiner.blocks.0.attn.qkv_proj") is None
    assert layer_key("blocks.0.adaln_proj.linear") is None


# ------------------------------------------------------------------------- files end to end

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics

    d = tmp_path_factory.mktemp("calib")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=3)
    dims = input_dims(src)
    ins = seeded_inputs(d, dims, range(5))  # 5 x 256 rows >= K = 1024 (fc2)
    stats = d / "a.stats"
    res = capture_statistics(src, ins, stats, predict=False)
    return {"d": d, "src": src, "inputs": ins, "stats": stats, "dims": dims, "result": res}


def test_capture_equals_a_forward_hook(world):
    """Block 0's qkv_proj statistics against the inputs a torch forward hook sees."""
    from h3quant.runtime.model.model import H3Model

    seen = []
    with H3Model.open(world["src"], linear="reference") as m:
        block = m.load_block(0, torch.float32)
        block.qkv_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
        from h3quant.pipelines.inputs_file import load_sigma, load_tensors

        for p in world["inputs"]:
            v, a, t = load_tensors(p, m.video_channels, m.audio_channels, m.text_dim)
            st = m.start(v, a, t, load_sigma(p))
            block(st.x, st.cond)
    x = torch.cat(seen).double()
    with Statistics(world["stats"]) as s:
        lay = s.layers["blocks.0.attn.qkv_proj"]
        assert lay.rows == x.shape[0] == 5 * 256
        torch.testing.assert_close(lay.hessian().double(), x.t() @ x, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(s.absmean("blocks.0.attn.qkv_proj").double(),
                                   x.abs().mean(0), rtol=1e-5, atol=1e-6)
        assert s.meta["blocks"] == 2 and len(s.meta["inputs"]) == 5
        assert s.meta["inputs"][0]["seed"] == "0" and len(s.meta["inputs"][0]["sha256"]) == 64


@pytest.mark.slow
def test_capture_is_deterministic(world):
    from h3quant.pipelines.capture import capture_statistics

    again = world["d"] / "again.stats"
    capture_statistics(world["src"], world["inputs"], again, predict=False)
    assert again.read_bytes() == world["stats"].read_bytes()


def _write_stats(path, src, hessians: dict, rows: int):
    """A statistics file written here (not by capture): identity or chosen Hessians."""
    from h3quant.calibration.capture import BlockWriter, stats_layout
    from h3quant.calibration.fingerprint import checkpoint_fingerprint

    meta = {"version": 1, "checkpoint": checkpoint_fingerprint(src), "blocks": 2, "inputs": [],
            "rows": {k: rows for k in hessians}, "forward": "float"}
    layout = stats_layout({k: h.shape[0] for k, h in hessians.items()},
                          {"h3quant.calibration": json.dumps(meta)})
    w = BlockWriter(path, layout)
    for k, h in hessians.items():
        w.write_tensor(f"{k}.hessian", h.float().contiguous())
        w.write_tensor(f"{k}.absmean", torch.ones(h.shape[0]))
    w.close(True)


def _identity_stats(world, rows=100_000):
    path = world["d"] / f"identity{rows}.stats"
    if not path.exists():
        with Statistics(world["stats"]) as s:
            ks = {k: lay.k for k, lay in s.layers.items()}
        _write_stats(path, world["src"], {k: torch.eye(n) * 3.0 for k, n in ks.items()}, rows)
    return path


def _tensors_equal(a, b):
    with Checkpoint(a) as x, Checkpoint(b) as y:
        assert set(x.tensors) == set(y.tensors)
        for n in x.tensors:
            assert bytes(x.read_bytes(n)) == bytes(y.read_bytes(n)), n
        mx, my = dict(x.metadata), dict(y.metadata)
        opts = json.loads(mx.pop("h3quant.options")), json.loads(my.pop("h3quant.options"))
        assert mx == my
        return opts


@pytest.mark.slow
@pytest.mark.parametrize("target", ["int8-convrot", "int8", "w4a8", "nvfp4", "int4-convrot"])
def test_identity_statistics_convert_bytes(world, target):
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    plain, cal = d / f"rtn_{target}.safetensors", d / f"idc_{target}.safetensors"
    convert(world["src"], plain, ConvertOptions(target=target, report=False, overwrite=True))
    convert(world["src"], cal, ConvertOptions(target=target, report=False, overwrite=True,
                                              calibration=str(_identity_stats(world))))
    _, opts = _tensors_equal(plain, cal)
    assert opts["calibration"].startswith("identity")


@pytest.mark.slow
def test_calibrated_convert_report_and_kitchen(world):
    """Real statistics change the codes; comfy-kitchen dequantizes them as the marker says."""
    from h3quant.formats.w4a8.tensors import decode_w4a8
    from h3quant.pipelines.convert import ConvertOptions, convert

    pytest.importorskip("comfy_kitchen.tensor")
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout

    d = world["d"]
    out = d / "cal_w4a8.safetensors"
    rep = convert(world["src"], out, ConvertOptions(
        target="w4a8", calibration=str(world["stats"]),
        calibration_heldout=str(world["stats"]), overwrite=True)).to_dict()
    layers = rep["layers"] if isinstance(rep["layers"], list) else list(rep["layers"].values())
    cal = [lay["calibration"] for lay in layers]
    assert len(cal) == 8 and all("predicted_gain_db" in c for c in cal)
    assert all(set(c["output_sqnr_db"]) == {"calibration", "heldout"} for c in cal)
    with Checkpoint(out) as b:
        name = "blocks.0.mlp.fc1"
        t = {s: b.read(f"{name}.{s}") for s in ("weight", "weight_s_rel", "weight_s_channel",
                                                 "weight_codebook")}
        from comfy_kitchen.tensor.base import QuantizedTensor

        lay = AsymW4A8Int8Layout.Params(scale=t["weight_s_rel"], s_channel=t["weight_s_channel"],
                                        codebook=t["weight_codebook"], orig_dtype=torch.float32,
                                        orig_shape=(t["weight"].shape[0], 2 * t["weight"].shape[1]))
        theirs = QuantizedTensor(t["weight"], "AsymW4A8Int8Layout", lay).dequantize().float()
        ours = decode_w4a8(t)
        assert torch.allclose(theirs, ours, rtol=0, atol=1e-5 * float(ours.abs().max()))


def test_int8_calibrated_file_reads_in_kitchen(world):
    from h3quant.pipelines.convert import ConvertOptions, convert

    ck_tensor = pytest.importorskip("comfy_kitchen.tensor")
    d = world["d"]
    rtn, out = d / "k_rtn.safetensors", d / "k_cal.safetensors"
    convert(world["src"], rtn, ConvertOptions(target="int8-convrot", report=False, overwrite=True))
    convert(world["src"], out, ConvertOptions(target="int8-convrot", report=False, overwrite=True,
                                              calibration=str(world["stats"])))
    with Checkpoint(world["src"]) as a, Checkpoint(out) as b, Checkpoint(rtn) as r:
        name = "blocks.1.attn.out_proj"
        ref = ck_tensor.QuantizedTensor.from_float(a.read(name + ".weight").float(),
                                                   "TensorWiseINT8Layout", per_channel=True,
                                                   convrot=True, convrot_groupsize=256)
        q = b.read(name + ".weight")
        assert torch.equal(b.read(name + ".weight_scale").reshape(-1),
                           ref._params.scale.reshape(-1))  # kitchen's scales, kept
        assert not torch.equal(q, r.read(name + ".weight"))  # the codes moved
        assert int(q.min()) >= -127
        from h3quant.formats.int8.tensors import decode_int8

        mine = decode_int8(q, b.read(name + ".weight_scale"), convrot=True, group_size=256)
        theirs = ck_tensor.QuantizedTensor(q, "TensorWiseINT8Layout", ref._params).dequantize()
        assert torch.equal(mine, theirs.float())


def _kitchen_decode(target, t):
    """The weight comfy-kitchen dequantizes from a layer's stored tensors (fp32)."""
    if target == "nvfp4":
        import comfy_kitchen as ck

        return ck.dequantize_nvfp4(t["weight"], t["weight_scale_2"], t["weight_scale"],
                                   torch.float32)
    from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight

    return dequantize_convrot_w4a4_weight(t["weight"], t["weight_scale"], 256,
                                          output_dtype=torch.float32)


def _kitchen_scales(target, w):
    """The scales comfy-kitchen's own quantizer chooses for ``w`` (rounding to nearest)."""
    from comfy_kitchen.tensor import QuantizedTensor

    layout = "TensorCoreNVFP4Layout" if target == "nvfp4" else "TensorCoreConvRotW4A4Layout"
    sd = QuantizedTensor.from_float(w, layout).state_dict("x.weight")
    return {k[len("x."):]: v for k, v in sd.items() if k != "x.weight"}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["nvfp4", "int4-convrot"])
def test_calibrated_4bit_file_reads_in_kitchen_and_beats_rounding(world, target):
    """Real statistics: kitchen's scales kept (nvfp4: its tensor scale; its block scales are
    chosen during the feedback and kitchen decodes them as we do), codes moved, comfy-kitchen's dequantize of the
    calibrated file has a higher output SQNR on the calibration inputs than rounding to
    nearest in every layer (H of the captured inputs); the same inputs give the same bytes."""
    pytest.importorskip("comfy_kitchen.tensor")
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    rtn, out, again = (d / f"{target}_{x}.safetensors" for x in ("rtn", "cal", "again"))
    convert(world["src"], rtn, ConvertOptions(target=target, report=False, overwrite=True))
    for p in (out, again):
        convert(world["src"], p, ConvertOptions(target=target, report=False, overwrite=True,
                                                calibration=str(world["stats"])))
    _tensors_equal(out, again)
    gains = []
    with Checkpoint(world["src"]) as a, Checkpoint(out) as b, Checkpoint(rtn) as r, \
            Statistics(world["stats"]) as s:
        for key, lay in s.layers.items():
            w = a.read(key + ".weight")
            n, k = w.shape
            tb = {n_[len(key) + 1:]: b.read(n_) for n_ in b.tensors if n_.startswith(key + ".")}
            tr = {n_[len(key) + 1:]: r.read(n_) for n_ in r.tensors if n_.startswith(key + ".")}
            for sfx, want in _kitchen_scales(target, w).items():  # kitchen's scales, kept
                if (target, sfx) == ("nvfp4", "weight_scale"):
                    continue  # chosen during the feedback; kitchen reads any (checked below)
                assert torch.equal(_raw(tb[sfx]).reshape(-1), _raw(want).reshape(-1)), (key, sfx)
            if target == "nvfp4":
                from h3quant.formats.nvfp4.tensors import decode_nvfp4

                mine = decode_nvfp4(tb["weight"], tb["weight_scale"], tb["weight_scale_2"])
                assert torch.equal(_kitchen_decode(target, tb), mine), key
            assert not torch.equal(tb["weight"], tr["weight"]), key  # the codes moved
            if target == "int4-convrot":
                from h3quant.formats.int4_convrot.tensors import count_minus8

                assert count_minus8(tb["weight"]) == 0  # codes in [-7, 7]
            h = lay.hessian()
            cal = output_sqnr_db(w.float(), _kitchen_decode(target, tb)[:n, :k], h)
            base = output_sqnr_db(w.float(), _kitchen_decode(target, tr)[:n, :k], h)
            gains.append(cal - base)
    assert len(gains) == 8 and min(gains) > 0.5, gains


@pytest.mark.slow
@pytest.mark.parametrize("target, basis", [("nvfp4", "plain"), ("int4-convrot", "convrot g=256")])
def test_4bit_report_calibrates_every_layer(world, target, basis):
    """The report says each nvfp4 / INT4 ConvRot layer was calibrated (in the basis the format
    quantizes in), with its predicted gain and output SQNR; no 'rounded to nearest' note."""
    from h3quant.pipelines.convert import ConvertOptions, convert

    out = world["d"] / f"rep_{target}.safetensors"
    rep = convert(world["src"], out, ConvertOptions(target=target, overwrite=True,
                                                    calibration=str(world["stats"]))).to_dict()
    layers = rep["layers"] if isinstance(rep["layers"], list) else list(rep["layers"].values())
    cal = [lay["calibration"] for lay in layers]
    assert len(cal) == 8
    for c in cal:
        assert c["basis"] == basis and "note" not in c, c
        assert c["predicted_gain_db"] > 0 and "calibration" in c["output_sqnr_db"]


def test_statistics_of_another_checkpoint_are_refused(world, tmp_path):
    other = tmp_path / "other.safetensors"
    synth_checkpoint(other, preset="tiny", blocks=2, seed=4)
    r = CliRunner().invoke(main, ["convert", str(other), str(tmp_path / "o.safetensors"),
                                  "--to", "int8", "--calibration", str(world["stats"])])
    assert r.exit_code == 2, r.output
    assert "another checkpoint" in r.output
    assert not (tmp_path / "o.safetensors").exists()


def test_too_few_rows_round_to_nearest_with_a_warning(world):
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    few = d / "few.stats"
    with Statistics(world["stats"]) as s:
        hs = {k: lay.hessian().clone() for k, lay in s.layers.items()}
    _write_stats(few, world["src"], hs, rows=300)  # < K = 512 and 1024
    logs = []
    out = d / "few.safetensors"
    rep = convert(world["src"], out, ConvertOptions(target="int8", overwrite=True,
                                                    calibration=str(few)), log=logs.append)
    assert any("rounded to nearest" in m for m in logs)
    layers = rep.to_dict()["layers"]
    layers = layers if isinstance(layers, list) else list(layers.values())
    assert all("rounded to nearest" in lay["calibration"]["note"] for lay in layers)
    rtn = d / "few_rtn.safetensors"
    convert(world["src"], rtn, ConvertOptions(target="int8", overwrite=True))
    _tensors_equal(rtn, out)  # every layer rounded to nearest: the uncalibrated bytes


@pytest.mark.slow
def test_capture_cli_warns_and_prints_gains(world, tmp_path):
    ins = world["inputs"][:2]  # 512 rows: below fc2's K = 1024
    args = ["capture", str(world["src"]), "--out", str(tmp_path / "s.stats")]
    for p in ins:
        args += ["--inputs", str(p)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "fewer rows" in r.output and "predicted gain" in r.output
    assert "blocks.1.mlp.fc2" in r.output
    r = CliRunner().invoke(main, args)  # the output exists: refused
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["capture", str(world["src"]), "--out", str(ins[0]),
                                  "--inputs", str(ins[0]), "--overwrite"])
    assert r.exit_code == 2  # an output may not name an input


def test_capture_help_has_examples():
    r = CliRunner().invoke(main, ["capture", "--help"])
    assert r.exit_code == 0 and "Examples:" in r.output and "--through" in r.output


@pytest.mark.slow
def test_capture_through_a_quantized_file(world):
    """--through: the forward runs on the quantized blocks; the statistics stay the source's."""
    from h3quant.calibration.fingerprint import checkpoint_fingerprint
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    q = d / "through_q.safetensors"
    convert(world["src"], q, ConvertOptions(target="w4a8", report=False, overwrite=True))
    out = d / "through.stats"
    capture_statistics(world["src"], world["inputs"], out, through=q, predict=False)
    with Statistics(out) as s, Statistics(world["stats"]) as f:
        assert s.meta["checkpoint"] == checkpoint_fingerprint(world["src"])
        assert s.meta["forward"] == checkpoint_fingerprint(q)
        a, b = s.layers["blocks.0.attn.qkv_proj"], f.layers["blocks.0.attn.qkv_proj"]
        torch.testing.assert_close(a.hessian(), b.hessian())  # block 0 sees the same inputs
        a, b = s.layers["blocks.1.mlp.fc2"], f.layers["blocks.1.mlp.fc2"]
        assert not torch.allclose(a.hessian(), b.hessian())  # later blocks see quantized ones


@pytest.mark.slow
def test_awq_w4a16_is_written_from_statistics_and_read_back(world):
    """convert --to awq-w4a16 needs statistics; with them the file validates and comfy-kitchen's
    AWQ reference dequantizes it as h3quant decodes it."""
    from h3quant.errors import ConvertError
    from h3quant.formats.awq_w4a16.encoder import decode_awq_w4a16
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.pipelines.headers.validate import validate_checkpoint

    eager = pytest.importorskip("comfy_kitchen.backends.eager.awq")
    with pytest.raises(ConvertError):
        ConvertOptions(target="awq-w4a16")
    out = world["d"] / "awq.safetensors"
    convert(world["src"], out, ConvertOptions(target="awq-w4a16", overwrite=True,
                                              calibration=str(world["stats"])))
    assert validate_checkpoint(out, deep=True).ok
    with Checkpoint(out) as c:
        name = "blocks.1.mlp.fc2"
        t = {s: c.read(f"{name}.{s}") for s in ("weight", "weight_scale", "weight_zeros")}
    k = 2 * t["weight"].shape[1]
    theirs = eager.gemv_awq_w4a16(torch.eye(k, dtype=t["weight_scale"].dtype), t["weight"],
                                  t["weight_scale"], t["weight_zeros"], group_size=64)
    ours = decode_awq_w4a16({"qweight": t["weight"], "wscales": t["weight_scale"],
                             "wzeros": t["weight_zeros"]})
    assert torch.equal(theirs.float().t(), ours.to(t["weight_scale"].dtype).float())
