"""``verify_checkpoint`` / ``h3quant verify`` / ``h3quant backends`` on tiny synthetic checkpoints."""

from __future__ import annotations

import json

import pytest
import scipy.linalg
import torch
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.pipelines.verify.blocks import Thresholds, data_checks, verify_checkpoint
from h3quant.runtime.loader import load_blocks
from helpers.h3files import quantize_file, rewrite, set_header_layer

pytestmark = pytest.mark.slow  # whole-model / verify runs on module-wide files: the slow subset

TOKENS = 16


def _sylvester(layer, parts, w):
    """Encode with Sylvester's Hadamard instead of the ConvRot H4 Kronecker power."""
    h = torch.tensor(scipy.linalg.hadamard(256), dtype=torch.float32) / 16
    rot = (w.float().reshape(w.shape[0], -1, 256) @ h).reshape(w.shape)
    s = (rot.abs().amax(1, keepdim=True) / 127).clamp_min(1e-30)
    return {"weight": torch.round(rot / s).clamp(-128, 127).to(torch.int8), "weight_scale": s}


def _scales_x4(t, meta):
    for n in t:
        if n.endswith(".weight_scale"):
            t[n] = t[n] * 4


# W4A8 on the two smaller linears only (the W4A8 encoder is slow on small CPUs): a mixed block.
W4A8_ROLES = {"attn.out_proj": "w4a8", "mlp.fc2": "w4a8"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_files):
    d = tmp_path_factory.mktemp("verify")
    base = tiny_files
    bf16, int8 = base["bf16"], base["int8"]
    return {
        "bf16": bf16, "int8": int8,
        "x4": rewrite(int8, d / "x4.safetensors", _scales_x4),
        "sylvester": quantize_file(bf16, d / "sylv.safetensors", mutate=_sylvester),
        "w4a8": quantize_file(bf16, d / "w4a8.safetensors", fmt=W4A8_ROLES),
    }


def run(path, **kw):
    kw.setdefault("device", "cpu")
    return verify_checkpoint(path, tokens=TOKENS, **kw)


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


# ------------------------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def cpu_int8(files):
    return run(files["int8"])


def test_int8_passes_on_cpu_against_its_dequantized_weights(cpu_int8):
    r = cpu_int8
    assert r.passed and r.reference == "dequantized" and r.blocks == [0]
    names = [(c.name, c.path) for c in r.layers]
    assert names == [("blocks.0.attn.qkv_proj", "plain"), ("blocks.0.attn.out_proj", "plain"),
                     ("blocks.0.mlp.fc1", "plain"), ("blocks.0.mlp.fc2", "plain"),
                     ("blocks.0.mlp.fc2", "swiglu")]
    for c in r.layers:
        assert c.backend == "torch-int8"
        assert 1e-4 < c.rel_err < 0.03 and c.cosine > 0.999  # activation quantization: ~0.008
    assert len(r.block_checks) == 1 and r.block_checks[0].sqnr_db > 25
    assert {d.check for d in r.data} == {"scales", "row-range", "saturation", "magnitude"}
    mags = [d.value for d in r.data if d.check == "magnitude"]
    assert len(mags) == 4 and all(0.6 < m < 1.6 for m in mags)


def test_int8_passes_against_the_bf16_reference(files):
    r = run(files["int8"], reference=files["bf16"])
    assert r.passed, r.failures
    assert all(1e-3 < c.rel_err < 0.03 for c in r.layers)  # weight + activation error ~0.01


def test_scales_x4_fail_without_a_reference(files):
    r = run(files["x4"])
    assert not r.passed
    failed = {(d.check, d.name) for d in r.data if not d.passed}
    assert failed == {("magnitude", f"blocks.0.{s}") for s in
                      ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    assert all(3.0 < d.value < 6.0 for d in r.data if d.check == "magnitude")
    assert all(c.passed for c in r.layers)  # the runtime itself agrees with the file


def test_scales_x4_fail_the_error_thresholds_with_a_reference(files):
    r = run(files["x4"], reference=files["bf16"])
    assert not r.passed
    assert all(2.9 < c.rel_err < 3.1 and not c.passed for c in r.layers)
    assert not r.block_checks[0].passed


def test_wrong_hadamard_fails_with_a_reference(files):
    r = run(files["sylvester"], reference=files["bf16"])
    assert not r.passed
    assert all(c.rel_err > 1.0 and not c.passed for c in r.layers)
    assert r.block_checks[0].sqnr_db < 0


def test_wrong_hadamard_is_invisible_without_a_reference(files):
    """Documented limit: it is an orthogonal mixing of each block's columns."""
    r = run(files["sylvester"])
    assert r.passed
    assert any("--reference" in n for n in r.notes)


def test_mixed_w4a8_block_passes_with_its_own_thresholds(files):
    """The fixed per-format limits (expected=False; the default holds a file to a fresh encode
    of the reference, tested in test_verdicts.py)."""
    r = run(files["w4a8"], reference=files["bf16"], expected=False)
    assert r.passed, r.failures
    w4 = [c for c in r.layers if c.format == "asym_w4a8_int8"]
    assert {c.name for c in w4} == {"blocks.0.attn.out_proj", "blocks.0.mlp.fc2"}
    assert all(c.limit == 0.12 and 0.03 < c.rel_err < 0.1 for c in w4)  # measured ~0.065
    assert all(c.limit == 0.05 and c.rel_err < 0.03 for c in r.layers if c not in w4)
    assert r.block_checks[0].limit_db == Thresholds().block_sqnr_db_w4a8
    assert r.block_checks[0].formats == ["asym_w4a8_int8", "int8_tensorwise"]
    peaks = [d for d in r.data if d.check == "row-range" and d.name.endswith("fc2")]
    assert peaks[0].passed and "96" in peaks[0].limit


def test_codes_written_against_other_scales_fail_the_row_checks(files, tmp_path):
    def edit(t, meta):
        q, s = t["blocks.0.attn.qkv_proj.weight"], t["blocks.0.attn.qkv_proj.weight_scale"]
        t["blocks.0.attn.qkv_proj.weight"] = torch.round(q.float() / 4).to(torch.int8)
        t["blocks.0.attn.qkv_proj.weight_scale"] = s * 4  # same weights, a quarter of the range
        q, s = t["blocks.0.mlp.fc1.weight"], t["blocks.0.mlp.fc1.weight_scale"]
        t["blocks.0.mlp.fc1.weight"] = (q.float() * 4).clamp(-128, 127).to(torch.int8)
        t["blocks.0.mlp.fc1.weight_scale"] = s / 4  # scale too small: codes clamp
    path = rewrite(files["int8"], tmp_path / "rows.safetensors", edit)
    blk = load_blocks(path, [0])[0]
    th = Thresholds()
    qkv = {d.check: d for d in data_checks(blk.linear("attn.qkv_proj"), th, {})}
    fc1 = {d.check: d for d in data_checks(blk.linear("mlp.fc1"), th, {})}
    ok = {d.check: d for d in data_checks(blk.linear("mlp.fc2"), th, {})}
    assert not qkv["row-range"].passed and qkv["row-range"].value > 0.99
    assert qkv["saturation"].passed and qkv["magnitude"].detail.startswith("skipped")
    assert not fc1["saturation"].passed and fc1["saturation"].value > 0.05
    assert all(d.passed for d in ok.values()) and ok["row-range"].value == 0


def test_bad_scales_fail_the_scale_check(files, tmp_path):
    blk = load_blocks(files["int8"], [0])[0]
    lay = blk.linear("attn.out_proj")
    lay.tensors["weight_scale"] = lay.tensors["weight_scale"].clone()
    lay.tensors["weight_scale"][3] = float("nan")
    lay._grid = None
    checks = {d.check: d for d in data_checks(lay, Thresholds(), {})}
    assert not checks["scales"].passed


def test_verify_setup_errors(files):
    from h3quant.errors import DeviceError, VerifyError

    with pytest.raises(VerifyError, match="no blocks"):
        run(files["int8"], blocks=[3])
    with pytest.raises(VerifyError, match="no quantized layer"):
        run(files["bf16"])
    with pytest.raises(DeviceError):
        run(files["int8"], device="gpu")
    with pytest.raises(VerifyError, match="float checkpoint"):
        run(files["int8"], reference=files["w4a8"])


def test_a_checkpoint_without_blocks_is_refused_by_per_block_and_tp_verify(tmp_path):
    from safetensors.torch import save_file

    from h3quant.errors import VerifyError
    from h3quant.pipelines.verify.tp import verify_tp

    f = tmp_path / "no_blocks.safetensors"
    save_file({"x_embedder.weight": torch.zeros(4, 4)}, str(f))
    with pytest.raises(VerifyError, match="no blocks.*not an H3 DiT checkpoint"):
        run(f)
    with pytest.raises(VerifyError, match="no blocks.*not an H3 DiT checkpoint"):
        verify_tp(f, tp=2)


# ------------------------------------------------------------------- simulated NPU and MPS


def test_simulated_npu_runs_every_layer_on_the_npu_backend(files, cpu_int8):
    from h3quant.cli.verify_view import render_blocks as render
    from h3quant.testing.sim_npu import simulated_npu

    with simulated_npu() as sim:
        r = verify_checkpoint(files["int8"], device="npu", tokens=TOKENS, probe=sim.probe)
        assert not sim.device.of_kind("cpu_fallback")  # aten::_int_mm never ran on the NPU
        calls = sim.extras["module"].calls
    assert r.passed, r.failures
    assert r.device == "npu" and {c.backend for c in r.layers} == {"npu"}
    assert calls.count("npu_quant_matmul") == 5 + 4  # 5 layer checks + 4 linears of the block
    # bf16 activations on the device vs fp32 on the CPU; both within the documented limit
    for npu, cpu in zip(r.layers, cpu_int8.layers):
        assert npu.rel_err <= npu.limit and abs(npu.rel_err - cpu.rel_err) < 0.01
    assert "npu" in render(r).split("blocks.0.mlp.fc2 [swiglu]")[1].splitlines()[0]


def test_simulated_mps_dequantizes_on_the_device(files, cpu_int8):
    from h3quant.testing.simdevice import simulated_mps

    with simulated_mps() as sim:  # any aten::_int_mm on the device would raise here
        r = verify_checkpoint(files["int8"], device="mps", tokens=TOKENS, probe=sim.probe)
        assert not sim.device.saw("aten::_int_mm")
    assert r.passed, r.failures
    assert {c.backend for c in r.layers} == {"dequant"}
    for mps, cpu in zip(r.layers, cpu_int8.layers):
        assert mps.rel_err <= mps.limit and abs(mps.rel_err - cpu.rel_err) < 0.01
    assert abs(r.block_checks[0].sqnr_db - cpu_int8.block_checks[0].sqnr_db) < 12


# ------------------------------------------------------------------------------------- CLI


def test_cli_verify_passes_with_a_text_table(files):
    res = cli("verify", files["int8"], "--device", "cpu", "--tokens", TOKENS, "--no-mmap",
              "--blocks", "1")
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip().endswith("PASS")
    rows = [line for line in res.stdout.splitlines() if line.startswith("blocks.0.")]
    assert len(rows) == 5 and all("torch-int8" in r and r.endswith("ok") for r in rows)
    assert "blocks.0.mlp.fc2 [swiglu]" in res.stdout


def test_result_json_document(cpu_int8):
    doc = json.loads(json.dumps(cpu_int8.to_dict(), allow_nan=False))
    assert doc["passed"] and doc["failures"] == [] and doc["blocks"] == [0]
    assert doc["thresholds"]["rel_err_int8"] == 0.05 and len(doc["layers"]) == 5
    assert doc["layers"][0]["backend"] == "torch-int8" and doc["device"] == "cpu"


@pytest.mark.parametrize("with_ref", [False, True])
def test_cli_verify_exits_1_on_scales_x4(files, with_ref):
    extra = ["--reference", files["bf16"]] if with_ref else []
    res = cli("verify", files["x4"], "--device", "cpu", "--tokens", TOKENS, "--json", *extra)
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert not doc["passed"] and doc["reference"] == (str(files["bf16"]) if with_ref else
                                                      "dequantized")
    kinds = {f.split()[0] for f in doc["failures"]}
    assert kinds == ({"layer", "block", "magnitude"} if with_ref else {"magnitude"})


def test_cli_verify_usage_and_io_errors(files, tmp_path):
    from h3quant.formats.markers import marker_tensor

    res = cli("verify", tmp_path / "missing.safetensors")
    assert res.exit_code == 2 and "h3quant: error" in res.output
    res = cli("verify", files["int8"], "--device", "tpu")
    assert res.exit_code == 2 and "invalid device" in res.output

    def fp8(t, meta):
        name = "blocks.0.mlp.fc1"
        t[name + ".weight"] = t[name + ".weight"].float().to(torch.float8_e4m3fn)
        t[name + ".comfy_quant"] = marker_tensor({"format": "float8_e4m3fn"})
        set_header_layer(meta, name, {"format": "float8_e4m3fn"})
    path = rewrite(files["int8"], tmp_path / "fp8.safetensors", fp8)
    res = cli("verify", path, "--device", "cpu", "--json")  # fp8 runs through its decode
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and "Q105" not in res.output, res.output
    fc1 = [c for c in doc["layers"] if c["name"] == "blocks.0.mlp.fc1"]
    assert fc1 and {c["format"] for c in fc1} == {"float8_e4m3fn"}
    assert {c["backend"] for c in fc1} == {"dequant"}
    assert "--reference" in cli("verify", "--help").output


def test_cli_backends(files):
    res = cli("backends", "--device", "cpu", "--json")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    by = {b["name"]: b for b in doc["backends"]}
    assert doc["device"] == "cpu"
    assert set(by) == {"reference", "torch-int8", "npu", "dequant", "kitchen"}
    assert by["torch-int8"]["available"] and by["torch-int8"]["preference"] == 1
    assert not by["npu"]["available"] and by["npu"]["reasons"]
    res = cli("backends", "--device", "mps")
    assert res.exit_code == 0 and "_int_mm" in res.output
    assert cli("backends", "--device", "gpu").exit_code == 2
