"""awq_w4a16: a file in comfy-kitchen's AWQ layout (built here) reads, validates, decodes as
kitchen dequantizes it, and converts to bf16 and int8; writing it is refused without
calibration statistics."""

import pytest
import torch

from helpers.forge import cli, codes, validate
from helpers.kitchen_files import awq_file, awq_quantize, block_linear_names, marker_tensor, read_all
from h3quant.formats.awq_w4a16.tensors import decode_awq
from h3quant.synth import synth_checkpoint

pytest.importorskip("comfy_kitchen")


def _kitchen_dequant(q, s, z, group, dtype):
    from comfy_kitchen.tensor.awq_w4a16 import TensorCoreAWQW4A16Layout as L

    n, k2 = q.shape
    params = L.Params(scale=s.to(dtype), zeros=z.to(dtype), group_size=group, orig_dtype=dtype,
                      orig_shape=(n, 2 * k2))
    return L.dequantize(q, params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [64, 128])
def test_decode_is_kitchens_dequantize(dtype, group):
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(2))
    q, s, z = awq_quantize(w, group, dtype)
    got = decode_awq(q, s.t(), z.t(), group, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, _kitchen_dequant(q, s, z, group, dtype))


def test_kitchens_gemv_runs_on_the_decoded_weight():
    import comfy_kitchen as ck

    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    q, s, z = awq_quantize(w, 64, torch.float32)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    want = ck.gemv_awq_w4a16(x, q, s, z, group_size=64)
    assert torch.equal(x @ decode_awq(q, s.t(), z.t(), 64).t(), want)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("awq") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=2, seed=8)
    return p


@pytest.fixture(scope="module")
def awq(src, tmp_path_factory):
    return awq_file(src, tmp_path_factory.mktemp("awqf") / "awq.safetensors")


def test_an_awq_file_inspects_and_validates_clean(awq):
    res, doc = validate(awq, "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert codes(doc) <= {"M113"} and doc["counts"]["error"] == 0  # markers as tensors only
    res = cli("inspect", awq, "--layers")
    assert res.exit_code == 0 and "awq_w4a16" in res.output


def test_convert_to_bf16_decodes_every_layer(src, awq, tmp_path):
    out = tmp_path / "back.safetensors"
    res = cli("convert", awq, out, "--to", "bf16", "-q")
    assert res.exit_code == 0, res.output
    a, k, b = read_all(src), read_all(awq), read_all(out)
    names = block_linear_names(b)
    assert len(names) == 8 and not any(n + ".comfy_quant" in b for n in names)
    for name in names:
        want = _kitchen_dequant(k[name + ".weight"], k[name + ".weight_scale"],
                                k[name + ".weight_zeros"], 64, torch.float32)
        assert torch.equal(b[name + ".weight"], want.bfloat16()), name
        w = a[name + ".weight"].float()
        assert ((b[name + ".weight"].float() - w).norm() / w.norm()) < 0.25, name  # 4-bit min/max


def test_convert_to_int8_convrot(awq, tmp_path):
    out = tmp_path / "i8.safetensors"
    res = cli("convert", awq, out, "--to", "int8-convrot", "-q")
    assert res.exit_code == 0, res.output
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0, doc["findings"]


def test_writing_awq_is_refused_without_calibration(src, tmp_path):
    out = tmp_path / "o.safetensors"
    res = cli("convert", src, out, "--to", "awq-w4a16")
    assert res.exit_code == 2 and "calibration" in res.output and not out.exists()
    res = cli("convert", src, out, "--to", "int8", "--layer", r"mlp\.=awq-w4a16")
    assert res.exit_code == 2 and "calibration" in res.output and not out.exists()


# ----------------------------------------------------------------------------- bad files


def _one_layer(tmp_path, mutate, marker=None):
    q, s, z = awq_quantize(torch.randn(32, 256, generator=torch.Generator().manual_seed(5)))
    t = {"lin.weight": q, "lin.weight_scale": s, "lin.weight_zeros": z,
         "lin.comfy_quant": marker_tensor(marker or {"format": "awq_w4a16", "group_size": 64})}
    mutate(t)
    from safetensors.torch import save_file

    p = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(p))
    return p


def _scale(value):
    def mutate(t):
        s = t["lin.weight_scale"].clone()
        s[1, 3] = value
        t["lin.weight_scale"] = s
    return mutate


NOOP = lambda t: None  # noqa: E731


@pytest.mark.parametrize("mutate, marker, code, deep", [
    (lambda t: t.update({"lin.weight": t["lin.weight"].to(torch.int32)}), None, "Q102", False),
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"].t()}), None, "Q103", False),
    (lambda t: t.pop("lin.weight_zeros"), None, "Q101", False),
    (lambda t: t.update({"lin.weight_zeros": t["lin.weight_zeros"].half()}), None, "Q123", False),
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"].to(torch.int8)}), None, "Q102",
     False),
    (NOOP, {"format": "awq_w4a16", "group_size": 48}, "Q123", False),
    (_scale(float("nan")), None, "D101", True),
    (_scale(0.0), None, "D102", True),
    (lambda t: t["lin.weight_zeros"].__setitem__((0, 0), float("inf")), None, "D106", True),
])
def test_bad_files_get_findings(tmp_path, mutate, marker, code, deep):
    p = _one_layer(tmp_path, mutate, marker)
    res, doc = validate(p, *(["--deep"] if deep else []))
    assert res.exit_code == 1 and code in codes(doc), doc["findings"]


# ----------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runtime_linear_is_comfyuis_awq_arithmetic_per_layer(awq, dtype):
    """Every layer of an AWQ file, run by the runtime on the CPU, gives the values of
    comfy-kitchen's ``gemv_awq_w4a16`` (what ComfyUI's linear calls there): computed in the
    scales' dtype (bf16) even for fp32 activations, not in fp32."""
    import comfy_kitchen as ck

    from h3quant.runtime.loader import load_blocks
    from h3quant.runtime.model.block import quantized_linear

    blocks = load_blocks(awq, [0, 1])
    checked = 0
    for block in blocks:
        for local in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            layer = block.linear(local)
            mod = quantized_linear(layer, device="cpu", compute_dtype=dtype)
            assert mod.backend_name == "emulated" and "gemv_awq_w4a16" in mod.fallback_reason
            t = layer.tensors
            x = torch.randn(5, layer.in_features,
                            generator=torch.Generator().manual_seed(checked)).to(dtype)
            bias = None if layer.bias is None else layer.bias.to(dtype)
            want = ck.gemv_awq_w4a16(x, t["weight"], t["weight_scale"], t["weight_zeros"],
                                     bias, group_size=64)
            got = mod(x)
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), layer.name
            fp32 = torch.nn.functional.linear(x.float(), layer.dequantize(torch.float32),
                                              None if bias is None else bias.float())
            if dtype == torch.float32:  # the fp32 product is another computation
                assert not torch.equal(got, fp32), layer.name
            checked += 1
    assert checked == 8
