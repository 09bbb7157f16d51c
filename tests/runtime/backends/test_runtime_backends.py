"""Every backend against the specification on CPU, the CUDA shape gate, selection and fallbacks.

Tolerances (relative L2 error against the fp32 reference ``reference_linear``, Gaussian data):
- torch-int8 (W8A8, bf16/fp16/fp32 output): <= 0.02 (measured ~0.008 at K=512);
- dequant (bf16 weight, bf16 matmul): <= 0.01 (measured ~0.002);
- reference backend cast to the activation dtype: <= 0.005;
- torch-int8 vs ``w8a8_emulation`` (FORMATS 3.2 with exact float64 accumulation): bit-identical.
"""

import pytest
import torch

from h3quant.convrot import rotate
from h3quant.errors import DeviceError, FormatError, UnsupportedError
from h3quant.runtime.backends import list_backends, reference_linear, w8a8_emulation
from h3quant.runtime.backends.base import LinearOptions
from h3quant.runtime.capabilities import CUDA_INT_MM_GATE, StaticProbe
from h3quant.formats.int8.tensors import quantize_activation as _quantize_activation
from h3quant.runtime.int8_math import quantize_activation as runtime_quantize_activation
from h3quant.runtime.int8_math import scale_accumulator
from h3quant.runtime.linear import QuantizedLinear
from helpers.runtime import quantize_weight, rel

TOL = {"torch-int8": 0.02, "dequant": 0.01, "reference": 0.005}




@pytest.fixture
def layer_data():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=g)
    x = torch.randn(2, 7, 512, generator=g)
    bias = torch.randn(48, generator=g)
    return w, x, bias


def test_worked_example_from_formats():
    # FORMATS.md 3.1 worked example, g = 4: acc = [10404, -27917], y = [4.8379, -10.7313].
    w = torch.tensor([[.5, -1, .25, 2, .1, .2, -.3, .4], [-.7, 0, 1.5, .3, .05, -.05, .6, -2.5]])
    q, s = quantize_weight(w, True, 4)
    assert q.tolist() == [[-76, 42, 127, 25, -14, 34, 0, 7], [20, -78, 45, 102, 127, -127, -74, -82]]
    x = torch.tensor([[8., 0, 0, 0, -1, .5, 0, 2]])
    q_x, s_x = _quantize_activation(rotate(x, 4))
    assert q_x.tolist() == [[127, 127, 127, -127, -40, 24, 8, 56]]
    assert torch._int_mm(torch.cat([q_x] * 17), q.t())[0].tolist() == [10404, -27917]
    layer = QuantizedLinear.from_int8(q, s, convrot=True, group_size=4, backend="torch-int8")
    y = layer(x)
    assert torch.allclose(y, torch.tensor([[4.8379, -10.7313]]), atol=1e-4)


def test_scale_applied_once():
    acc = torch.tensor([[10, -20], [3, 4]], dtype=torch.int32)
    s_x = torch.tensor([0.5, 2.0])
    s = torch.tensor([0.25, 4.0])
    y = scale_accumulator(acc, s_x, s, torch.float32)
    assert y.tolist() == [[1.25, -40.0], [1.5, 32.0]]


def test_quantize_activation_rule():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [127.0, 63.5, -0.5, 1.5]])
    q, s = _quantize_activation(x)
    assert s.dtype == torch.float32 and q.dtype == torch.int8
    assert torch.equal(s, torch.tensor([2 / 127, 1e-30, 1.0]))
    assert q[0].tolist() == [64, -127, 32, 0]
    assert q[1].tolist() == [0, 0, 0, 0]
    assert q[2].tolist() == [127, 64, 0, 2]  # round half to even: 63.5 -> 64, -0.5 -> 0, 1.5 -> 2


@pytest.mark.parametrize("backend", ["torch-int8", "dequant", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("convrot", [True, False])
def test_backend_vs_reference(layer_data, backend, dtype, convrot):
    w, x, bias = layer_data
    q, s = quantize_weight(w, convrot)
    layer = QuantizedLinear.from_int8(q, s, convrot=convrot, bias=bias, backend=backend)
    assert layer.backend_name == backend
    xd = x.to(dtype)
    y = layer(xd)
    assert y.dtype == dtype and y.shape == (2, 7, 48)
    ref = reference_linear(xd, q, s, convrot, 256, bias)
    assert rel(y, ref) <= TOL[backend]
    # the reference itself reproduces the float layer up to weight quantization
    assert rel(ref, xd.float() @ w.t() + bias) < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_int8_bit_exact_vs_emulation(layer_data, dtype):
    w, x, bias = layer_data
    q, s = quantize_weight(w)
    layer = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias)
    assert layer.backend_name == "torch-int8"
    xd = x.to(dtype)
    assert torch.equal(layer(xd), w8a8_emulation(xd, q, s, True, 256, bias))


@pytest.mark.parametrize("shape", [(48, 1), (48,), (), (1,)])
def test_scale_shapes_kept_exactly(layer_data, shape):
    w, x, _ = layer_data
    q, s = quantize_weight(w, convrot=False)
    if shape in ((), (1,)):
        s = s.max().reshape(shape)
    else:
        s = s.reshape(shape)
    layer = QuantizedLinear.from_int8(q, s, convrot=False)
    assert layer.weight_scale.shape == s.shape and torch.equal(layer.weight_scale, s)
    assert torch.equal(layer.weight, q) and layer.weight.dtype == torch.int8
    xb = x.to(torch.bfloat16)
    assert torch.equal(layer(xb), w8a8_emulation(xb, q, s, False, 256))


@pytest.mark.parametrize(
    "kwargs, err",
    [({"q": torch.zeros(4, 8)}, FormatError),
     ({"scale": torch.ones(4, 1, dtype=torch.float16)}, FormatError),
     ({"scale": torch.ones(3)}, FormatError),
     ({"bias": torch.ones(5)}, FormatError),
     ({"convrot": True, "group_size": 8}, FormatError),
     ({"convrot": True, "group_size": 16}, FormatError),
     ({"device": "gpu"}, DeviceError),
     ({"backend": "nope"}, DeviceError)],
)
def test_from_int8_validation(kwargs, err):
    args = {"q": torch.zeros(4, 8, dtype=torch.int8), "scale": torch.ones(4, 1), "convrot": False}
    args.update(kwargs)
    with pytest.raises(err):
        QuantizedLinear.from_int8(args.pop("q"), args.pop("scale"), **args)


def test_forward_validation():
    layer = QuantizedLinear.from_int8(torch.ones(4, 8, dtype=torch.int8), torch.ones(4), convrot=False)
    with pytest.raises(FormatError):
        layer(torch.zeros(3, 9))
    with pytest.raises(FormatError):
        layer(torch.zeros(3, 8, dtype=torch.int32))
    with pytest.raises(FormatError):
        layer(torch.zeros(3, 15), input_act="swiglu")
    with pytest.raises(UnsupportedError):
        layer(torch.zeros(3, 8), input_act="gelu")
    with pytest.raises(DeviceError):
        layer(torch.zeros(3, 8, device="meta"))
    assert layer(torch.zeros(0, 8)).shape == (0, 4)


class _CudaLikeIntMm:
    """Stands in for torch._int_mm under CUDA's constraints (M > 16, K % 8, N % 8) and records shapes."""

    def __init__(self, real):
        self.real, self.shapes = real, []

    def __call__(self, a, b):
        m, k = a.shape
        n = b.shape[1]
        self.shapes.append((m, k, n))
        if m <= 16 or k % 8 or n % 8:
            raise RuntimeError(f"simulated CUDA _int_mm constraint violated: {(m, k, n)}")
        return self.real(a, b)


CUDA_GATED_CPU = StaticProbe(name="cuda-gate-on-cpu", shape_gates={"cpu": CUDA_INT_MM_GATE})


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_cuda_gate_pads_m(monkeypatch, m):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 64, generator=g)
    q, s = quantize_weight(w, True, 16)
    fake = _CudaLikeIntMm(torch._int_mm)
    monkeypatch.setattr(torch, "_int_mm", fake)
    layer = QuantizedLinear.from_int8(q, s, convrot=True, group_size=16, probe=CUDA_GATED_CPU)
    assert layer.backend_name == "torch-int8"
    x = torch.randn(m, 64, generator=g, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (m, 24)
    assert fake.shapes == [(m if m > 16 else 32, 64, 24)]
    monkeypatch.undo()
    assert torch.equal(y, w8a8_emulation(x, q, s, True, 16))


@pytest.mark.parametrize("n, k", [(24, 36), (20, 64)])
def test_cuda_gate_kn_falls_back_to_dequant(monkeypatch, n, k):
    g = torch.Generator().manual_seed(2)
    q, s = quantize_weight(torch.randn(n, k, generator=g), convrot=False)
    fake = _CudaLikeIntMm(torch._int_mm)
    monkeypatch.setattr(torch, "_int_mm", fake)
    layer = QuantizedLinear.from_int8(q, s, convrot=False, probe=CUDA_GATED_CPU, backend="torch-int8")
    assert layer.backend_name == "dequant"
    assert "shape gate" in layer.fallback_reason
    x = torch.randn(20, k, generator=g, dtype=torch.bfloat16)
    y = layer(x)
    assert fake.shapes == [] and y.device.type == "cpu"
    assert rel(y, reference_linear(x, q, s, False, 256)) <= TOL["dequant"]


def test_full_precision_always_dequant(monkeypatch, layer_data):
    w, x, bias = layer_data
    q, s = quantize_weight(w)
    for requested in (None, "torch-int8", "dequant"):
        layer = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias, full_precision=True,
                                          backend=requested)
        assert layer.backend_name == "dequant"
        assert layer.fallback_reason == "layer is full_precision_matrix_mult"

    def boom(*a, **k):
        raise AssertionError("full-precision layer reached _int_mm")

    monkeypatch.setattr(torch, "_int_mm", boom)
    xb = x.to(torch.bfloat16)
    y_plain = layer(xb)
    assert rel(y_plain, reference_linear(xb, q, s, True, 256, bias)) <= TOL["dequant"]
    x2 = torch.cat([xb, xb], dim=-1)
    assert layer(x2, input_act="swiglu").shape == (2, 7, 48)


def test_dequant_cache_and_budget(layer_data):
    w, x, _ = layer_data
    q, s = quantize_weight(w)
    xb = x.to(torch.bfloat16)
    resident = QuantizedLinear.from_int8(q, s, convrot=True, backend="dequant")
    per_call = QuantizedLinear.from_int8(q, s, convrot=True, backend="dequant",
                                         options=LinearOptions(dequant_budget_bytes=1024))
    off = QuantizedLinear.from_int8(q, s, convrot=True, backend="dequant",
                                    options=LinearOptions(dequant_cache=False))
    assert resident.runner.resident and not per_call.runner.resident and not off.runner.resident
    assert torch.equal(resident(xb), per_call(xb)) and torch.equal(resident(xb), off(xb))
    # fp32 activations never reuse the bf16 resident copy: dequantized fresh in fp32
    y32 = resident(x)
    assert y32.dtype == torch.float32
    assert rel(y32, reference_linear(x, q, s, True, 256)) < 1e-5


def test_requested_unavailable_lists_every_backend():
    with pytest.raises(DeviceError) as e:
        QuantizedLinear.from_int8(torch.ones(8, 16, dtype=torch.int8), torch.ones(8), convrot=False,
                                  backend="npu")
    text = str(e.value)
    for name in ("reference", "torch-int8", "npu", "dequant", "kitchen"):
        assert f"{name}:" in text
    assert "device is cpu, not npu" in text


def test_list_backends_cpu():
    rows = {r.name: r for r in list_backends("cpu")}
    assert set(rows) == {"reference", "torch-int8", "npu", "dequant", "kitchen"}
    assert rows["torch-int8"].available and rows["dequant"].available and rows["reference"].available
    assert not rows["npu"].available and not rows["kitchen"].available
    assert rows["kitchen"].reason == "runs on CUDA only (device is cpu)"
    assert rows["torch-int8"].reason == "ok"


def test_kitchen_cuda_requirements():
    probe = StaticProbe(cuda=True, cuda_cc=(7, 0), kitchen=None)
    rows = {r.name: r for r in list_backends("cuda", probe)}
    assert not rows["kitchen"].available and "comfy_kitchen" in rows["kitchen"].reason
    ck = pytest.importorskip("comfy_kitchen")
    probe = StaticProbe(cuda=True, cuda_cc=(7, 0), kitchen=ck)
    assert "SM >= 7.5" in {r.name: r for r in list_backends("cuda", probe)}["kitchen"].reason
    probe = StaticProbe(cuda=True, cuda_cc=(8, 9), kitchen=ck)
    assert {r.name: r for r in list_backends("cuda", probe)}["kitchen"].available


def test_kitchen_oracle_agrees_on_cpu(layer_data):
    ck = pytest.importorskip("comfy_kitchen")
    w, x, bias = layer_data
    q, s = quantize_weight(w)
    xb = x.to(torch.bfloat16)
    ours = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias)(xb)
    theirs = ck.int8_linear(xb, q, s, bias, torch.bfloat16, convrot=True, convrot_groupsize=256)
    # kitchen rotates/quantizes in bf16, we in fp32: a few activation codes differ by one
    assert rel(ours, theirs) < 0.01


def test_runtime_activation_path_is_rotation_then_the_codec_quantizer():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 37, 256, generator=g) * torch.logspace(-3, 3, 37)[None, :, None]
    x[0, 4] = 0
    x[1, 5, :] = 0.5  # ties
    q_rt, s_rt = runtime_quantize_activation(x, True, 64)
    q_c, s_c = _quantize_activation(rotate(x, 64).reshape(-1, 256))
    assert torch.equal(q_rt, q_c) and torch.equal(s_rt, s_c)
    q_rt, s_rt = runtime_quantize_activation(x, False, 64)
    q_c, s_c = _quantize_activation(x.reshape(-1, 256))
    assert torch.equal(q_rt, q_c) and torch.equal(s_rt, s_c)


def test_kitchen_runner_plumbing_on_cpu(layer_data):
    # The kitchen backend only offers itself on CUDA; bind its runner directly to check that the
    # tensors, scale shape and fused activation reach comfy_kitchen.int8_linear correctly.
    ck = pytest.importorskip("comfy_kitchen")
    from h3quant.runtime.backends.base import Int8Weights
    from h3quant.runtime.backends.kitchen import KitchenBackend
    from h3quant.runtime.devices import Device

    w, x, bias = layer_data
    q, s = quantize_weight(w)
    weights = Int8Weights(q, s, s.reshape(-1), bias, True, 256)
    probe = StaticProbe(cuda=True, cuda_cc=(8, 9), kitchen=ck)
    runner = KitchenBackend().bind(weights, Device("cpu"), probe, LinearOptions())
    h = torch.cat([x, x.flip(-1)], dim=-1).to(torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    y = runner.forward(h, "swiglu")
    assert y.dtype == torch.bfloat16 and y.shape == (2, 7, 48)
    assert rel(y, reference_linear(act, q, s, True, 256, bias)) <= TOL["torch-int8"]
    assert torch.equal(y, runner.forward(act, None))
