"""INT4 ConvRot (convrot_w4a4): bytes equal to comfy-kitchen's quantizer, kitchen-written files
read clean, bad files get findings, the emulated forward equals kitchen's eager path."""

import os

import pytest
import torch

from helpers.forge import cli, codes, validate
from helpers.kitchen_files import block_linear_names, kitchen_file, kitchen_quantize, marker_tensor, read_all
from h3quant.formats.int4_convrot.tensors import (decode_int4_convrot, encode_int4_convrot,
                                                  w4a4_linear)
from h3quant.synth import synth_checkpoint

pytest.importorskip("comfy_kitchen")
LAYOUT = "TensorCoreConvRotW4A4Layout"


def _weight(n, k, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, k, generator=g))
    return w.to(dtype)


@pytest.mark.parametrize("shape, g", [((64, 512), 256), ((33, 256), 64), ((16, 1024), 16),
                                      ((130, 1024), 1024), ((8, 64), 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_is_kitchens_bytes(shape, g, dtype):
    w = _weight(*shape, dtype=dtype)
    w[1] = 0
    ref = kitchen_quantize(w, LAYOUT, convrot_groupsize=g)
    q, s = encode_int4_convrot(w, g)
    assert q.dtype == ref["weight"].dtype == torch.int8 and torch.equal(q, ref["weight"])
    assert s.dtype == torch.float32 and torch.equal(s, ref["weight_scale"])


def test_row_chunks_equal_one_call():
    w = _weight(300, 512, seed=2)
    q, s = encode_int4_convrot(w)
    q2, s2 = encode_int4_convrot(w[100:170])
    assert torch.equal(q[100:170], q2) and torch.equal(s[100:170], s2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_kitchens_dequantize(dtype):
    from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight

    q, s = encode_int4_convrot(_weight(40, 512, seed=4), 256)
    want = dequantize_convrot_w4a4_weight(q, s, 256, output_dtype=dtype)
    assert torch.equal(decode_int4_convrot(q, s, 256, dtype=dtype), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_forward_is_kitchens_eager_w4a4(dtype):
    from comfy_kitchen.backends.eager.convrot_w4a4 import convrot_w4a4_linear

    q, s = encode_int4_convrot(_weight(96, 512, seed=6), 256)
    x = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    b = torch.randn(96).to(dtype)
    assert torch.equal(w4a4_linear(x, q, s, 256, b), convrot_w4a4_linear(x, q, s, b, 256))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("int4") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=2, seed=6)
    return p


@pytest.mark.parametrize("g", [256, 64])
def test_convert_writes_kitchens_bytes_for_every_layer(src, tmp_path, g):
    out = tmp_path / "int4.safetensors"
    res = cli("convert", src, out, "--to", "int4-convrot", "--group-size", g, "-q")
    assert res.exit_code == 0, res.output
    a, b = read_all(src), read_all(out)
    names = block_linear_names(a)
    assert len(names) == 8
    for name in names:
        ref = kitchen_quantize(a[name + ".weight"], LAYOUT, convrot_groupsize=g)
        for suffix, want in ref.items():
            got = b[f"{name}.{suffix}"]
            assert got.dtype == want.dtype and torch.equal(got, want), (name, suffix)
        marker = bytes(b[name + ".comfy_quant"].tolist()).decode()
        assert marker == f'{{"format": "convrot_w4a4", "convrot_groupsize": {g}}}'
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0 and not doc["findings"], doc["findings"]


@pytest.fixture(scope="module")
def kitchen_made(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4k") / "kitchen.safetensors"
    return kitchen_file(src, out, LAYOUT, {"format": "convrot_w4a4", "convrot_groupsize": 256})


def test_a_kitchen_file_inspects_and_validates_clean(kitchen_made):
    res, doc = validate(kitchen_made, "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert codes(doc) <= {"M113"} and doc["counts"]["error"] == 0  # markers as tensors only
    res = cli("inspect", kitchen_made, "--layers")
    assert res.exit_code == 0 and "convrot_w4a4" in res.output


def test_convert_to_bf16_undoes_the_rotation_as_kitchen_does(src, kitchen_made, tmp_path):
    from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight

    out = tmp_path / "back.safetensors"
    res = cli("convert", kitchen_made, out, "--to", "bf16", "-q")
    assert res.exit_code == 0, res.output
    a, k, b = read_all(src), read_all(kitchen_made), read_all(out)
    for name in block_linear_names(b):
        want = dequantize_convrot_w4a4_weight(k[name + ".weight"], k[name + ".weight_scale"], 256)
        assert torch.equal(b[name + ".weight"], want.bfloat16()), name
        w = a[name + ".weight"].float()  # back in the original basis: near the source
        assert ((b[name + ".weight"].float() - w).norm() / w.norm()) < 0.2, name


def test_from_int4_convrot_to_nvfp4(kitchen_made, tmp_path):
    out = tmp_path / "nv.safetensors"
    res = cli("convert", kitchen_made, out, "--to", "nvfp4", "-q")
    assert res.exit_code == 0, res.output
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0, doc["findings"]


# ----------------------------------------------------------------------------- bad files


def _one_layer(tmp_path, mutate, marker=None, n=64, k=512, g=256):
    q, s = encode_int4_convrot(_weight(n, k, seed=9), g)
    t = {"lin.weight": q, "lin.weight_scale": s,
         "lin.comfy_quant": marker_tensor(marker or {"format": "convrot_w4a4",
                                                     "convrot_groupsize": 256})}
    mutate(t)
    from safetensors.torch import save_file

    p = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(p))
    return p


def _scale(value):
    def mutate(t):
        s = t["lin.weight_scale"].clone()
        s[5] = value
        t["lin.weight_scale"] = s
    return mutate


def _minus8(t):
    q = t["lin.weight"].clone()
    q[0, 0] = (q[0, 0] & 0x70) | 0x08  # low nibble -8
    t["lin.weight"] = q


NOOP = lambda t: None  # noqa: E731


@pytest.mark.parametrize("mutate, marker, code, deep", [
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"].bfloat16()}), None, "Q102", False),
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"][:10]}), None, "Q103", False),
    (lambda t: t.update({"lin.weight": t["lin.weight"].view(torch.uint8)}), None, "Q102", False),
    (lambda t: t.pop("lin.weight_scale"), None, "Q101", False),
    (NOOP, {"format": "convrot_w4a4", "convrot_groupsize": 100}, "Q104", False),
    (NOOP, {"format": "convrot_w4a4", "convrot_groupsize": 1024}, "Q104", False),  # K=512
    (NOOP, {"format": "convrot_w4a4", "quant_group_size": 128}, "Q121", False),
    (NOOP, {"format": "convrot_w4a4", "linear_dtype": "fp4"}, "Q122", False),
    (_scale(float("nan")), None, "D101", True),
    (_scale(float("inf")), None, "D101", True),
    (_scale(0.0), None, "D102", True),
    (_scale(-0.5), None, "D102", True),
    (_minus8, None, "D122", True),
])
def test_bad_files_get_findings(tmp_path, mutate, marker, code, deep):
    p = _one_layer(tmp_path, mutate, marker)
    res, doc = validate(p, *(["--deep"] if deep else []))
    assert code in codes(doc), doc["findings"]
    assert res.exit_code == (0 if code == "D122" else 1)  # D122 is a warning


def test_k_not_a_multiple_of_the_kernel_group(tmp_path):
    def narrow(t):  # K = 48: a multiple of the group size 16, not of the kernel's 64
        t["lin.weight"] = t["lin.weight"][:, :24].contiguous()
    p = _one_layer(tmp_path, narrow, {"format": "convrot_w4a4", "convrot_groupsize": 16}, g=16)
    res, doc = validate(p)
    assert res.exit_code == 1 and "Q121" in codes(doc), doc["findings"]


def test_convert_refuses_a_width_the_kernel_cannot_take(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "odd.safetensors"
    save_file({"lin.weight": _weight(8, 96)}, str(p))
    out = tmp_path / "o.safetensors"
    res = cli("convert", p, out, "--to", "int4-convrot", "--group-size", 16, "--preset",
              "all-linears")
    assert "not divisible by the int4 kernel's group size 64" in res.output


@pytest.mark.skipif(not os.environ.get("H3QUANT_SLOW"), reason="full dims: set H3QUANT_SLOW=1")
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(5376, 5376), (21504, 5376), (5376, 14336)])
def test_full_dims_bytes(shape):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    ref = kitchen_quantize(w, LAYOUT, convrot_groupsize=256)
    q, s = encode_int4_convrot(w, 256)
    assert torch.equal(q, ref["weight"]) and torch.equal(s, ref["weight_scale"])


def _kitchen_forward(x, q, s, bias, n, k):
    """ComfyUI's linear of a convrot_w4a4 weight: comfy-kitchen's QuantizedTensor under
    ``F.linear``, dispatched by kitchen's own registry (its eager backend on the CPU)."""
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.convrot_w4a4 import TensorCoreConvRotW4A4Layout

    params = TensorCoreConvRotW4A4Layout.Params(scale=s, orig_dtype=x.dtype, orig_shape=(n, k),
                                                 convrot_groupsize=256)
    return torch.nn.functional.linear(x, QuantizedTensor(q, LAYOUT, params), bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runtime_linear_on_the_cpu_is_comfyuis_w4a4_forward(kitchen_made, dtype):
    """The runtime runs a kitchen-written layer as ComfyUI does on the CPU (activations
    quantized to int4 too), not through the dequantized weight (which verify would flatter)."""
    from h3quant.runtime.loader import load_blocks
    from h3quant.runtime.model.block import quantized_linear

    layer = load_blocks(kitchen_made, [0])[0].linear("mlp.fc1")
    mod = quantized_linear(layer, device="cpu", compute_dtype=dtype)
    assert mod.backend_name == "emulated" and "int4" in mod.fallback_reason
    n, k = layer.out_features, layer.in_features
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = layer.bias
    got = mod(x)
    q, s = layer.tensors["weight"], layer.tensors["weight_scale"]
    want = _kitchen_forward(x, q, s, None if bias is None else bias.to(dtype), n, k)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    dequant = torch.nn.functional.linear(x, layer.dequantize(dtype),
                                         None if bias is None else bias.to(dtype))
    assert not torch.equal(got, dequant)
    assert (got.float() - dequant.float()).abs().max() > 1e-2 * dequant.float().abs().max()


def test_backends_say_what_runs_int4_convrot():
    from h3quant.runtime.decoded import format_routes
    from h3quant.runtime.probe import StaticProbe

    def runs(device, probe):
        return {r.format: r for r in format_routes(device, probe)}["convrot_w4a4"]

    cpu = runs("cpu", StaticProbe())
    assert cpu.runs == "emulated" and "int4" in cpu.comfy and "eager" in cpu.comfy
    gpu = runs("cuda", StaticProbe(cuda=True, cuda_cc=(8, 6)))
    assert gpu.runs == "dequant" and "int4 MMA" in gpu.comfy
    fp8 = {r.format: r for r in format_routes("cpu", StaticProbe())}["float8_e4m3fn"]
    assert fp8.runs == "dequant"
    res = cli("backends", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    import json
    rows = {r["format"]: r for r in json.loads(res.output)["formats"]}
    assert rows["convrot_w4a4"]["runs"] == "emulated"


@pytest.mark.slow
def test_verify_runs_the_cpu_forward_within_the_formats_limits(src, tmp_path):
    """verify judges the emulated forward by the format's own limits (synthetic weights), and
    still fails a file whose rows were reordered."""
    from safetensors.torch import save_file

    from h3quant.pipelines.verify.blocks import verify_checkpoint

    out = tmp_path / "int4.safetensors"
    assert cli("convert", src, out, "--to", "int4-convrot", "-q").exit_code == 0
    res = verify_checkpoint(out, reference=src, device="cpu", expected=False)  # fixed limits
    assert res.passed, res.failures
    assert {c.backend for c in res.layers} == {"emulated"}
    assert {c.limit for c in res.layers} == {0.35}
    t = read_all(out)
    name = block_linear_names(t)[0]
    for suffix in (".weight", ".weight_scale"):
        t[name + suffix] = t[name + suffix].flip(0).contiguous()
    bad = tmp_path / "bad.safetensors"
    save_file(t, str(bad))
    res = verify_checkpoint(bad, reference=src, device="cpu")
    assert not res.passed and any(not c.passed for c in res.layers)
