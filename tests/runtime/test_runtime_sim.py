"""Regression tests on SIMULATED Ascend NPU and MPS devices: the fused SwiGLU call never reaches
``_int_mm`` where the plain call would not, device detection never trusts ``torch.version.cuda``,
and the NPU int8 product stays on the NPU with its scales applied exactly once.

The simulations (h3quant.testing.sim_npu, h3quant.testing.simdevice) run on the CPU; see their
docstrings for what they model. Tolerances: NPU output vs ``w8a8_emulation`` of the same
bf16-rounded rotated activation: bit-identical without bias, rel L2 <= 0.01 with bias (the op adds
the bias in fp32 before the cast); any backend vs the fp32 reference: rel L2 <= 0.02.
"""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from h3quant.convrot import rotate
from h3quant.errors import DeviceError
from h3quant.runtime.backends import list_backends, reference_linear, w8a8_emulation
from h3quant.runtime.backends.base import Int8Weights
from h3quant.runtime.backends.npu import npu_layer_reasons
from h3quant.runtime.capabilities import LiveProbe
from h3quant.runtime.devices import parse_device
from h3quant.runtime.linear import QuantizedLinear
from h3quant.testing.sim_npu import SimulatedTorchNpu, simulated_npu
from h3quant.testing.simdevice import SimTensor, simulated_mps
from helpers.runtime import quantize_weight, rel

if importlib.util.find_spec("torch_npu") is not None:  # pragma: no cover
    pytest.skip("a real torch_npu is installed; the simulation would shadow it", allow_module_level=True)




def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(5)
    q, s = quantize_weight(torch.randn(64, 512, generator=g))
    x = torch.randn(2, 9, 512, generator=g, dtype=torch.bfloat16)
    bias = torch.randn(64, generator=g, dtype=torch.bfloat16)
    return q, s, x, bias


CUDA_FUNCS = ("get_device_capability", "current_device", "device_count", "set_device",
              "synchronize", "get_device_properties", "mem_get_info", "get_device_name")


def _forbid_cuda(monkeypatch):
    for name in CUDA_FUNCS:
        def boom(*a, _n=name, **k):
            raise AssertionError(f"torch.cuda.{_n} called on an NPU machine")
        monkeypatch.setattr(torch.cuda, name, boom)


# ---- NPU ---------------------------------------------------------------------------------------

def test_simulation_installs_and_restores():
    before = (sys.modules.get("torch_npu"), torch.version.cuda)
    with simulated_npu() as sim:
        assert sys.modules["torch_npu"] is sim.extras["module"]
        assert torch.version.cuda == "12.1" and torch.npu.is_available()
        assert not torch.cuda.is_available()
        assert torch.accelerator.is_available()
    assert (sys.modules.get("torch_npu"), torch.version.cuda) == before
    # process-wide leftovers (renamed PrivateUse1, torch.npu) say "no NPU" outside a simulation
    assert not torch.npu.is_available() and not torch.accelerator.is_available()
    assert not LiveProbe().npu_available()


def test_seed3_cuda_version_on_npu_build_selects_npu(monkeypatch, data):
    q, s, x, _ = data
    _forbid_cuda(monkeypatch)
    with simulated_npu(cuda_version="12.1") as sim:
        probe = LiveProbe()  # reads the simulated environment like production code would
        assert probe.cuda_version == "12.1" and not probe.cuda_available()
        assert parse_device("auto", probe=probe).kind == "npu"
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="auto", probe=probe)
        assert layer.backend_name == "npu" and layer.device.kind == "npu"
        rows = {r.name: r for r in list_backends("auto", probe)}
        assert rows["kitchen"].reason == "runs on CUDA only (device is npu)"
        assert not rows["torch-int8"].available
        y = layer(sim.device.put(x))
        assert y.device.type == "npu"
        assert layer.runner.torch_npu is sys.modules["torch_npu"]
        assert sim.extras["module"].calls == ["npu_rotate_quant", "npu_quant_matmul"]


def test_seed4_no_double_scaling(data):
    q, s, x, _ = data
    with simulated_npu(rotate_quant=False) as sim:  # rotate, then npu_dynamic_quant
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        y = sim.device.fetch(layer(sim.device.put(x)))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 9, 64)
    x_rot_bf16 = rotate(x, 256).to(torch.bfloat16)  # what npu_dynamic_quant receives
    assert torch.equal(y, w8a8_emulation(x_rot_bf16, q, s, False, 256))
    ref = reference_linear(x, q, s, True, 256)
    assert rel(y, ref) < 0.02
    gain = ((y.float() * ref).sum() / (ref * ref).sum()).item()
    assert abs(gain - 1) < 0.02  # a second s_x * s (~1e-4) would collapse this


def test_npu_bias_applied_once(data):
    q, s, x, bias = data
    with simulated_npu(rotate_quant=False) as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias, device="npu", probe=sim.probe)
        y = sim.device.fetch(layer(sim.device.put(x)))
    expect = w8a8_emulation(rotate(x, 256).to(torch.bfloat16), q, s, False, 256, bias)
    assert rel(y, expect) < 0.01
    assert rel(y, reference_linear(x, q, s, True, 256, bias)) < 0.02


@pytest.mark.parametrize("fused", [False, True])
def test_npu_no_int_mm_and_nothing_leaves_the_device(data, fused):
    q, s, x, _ = data
    with simulated_npu(rotate_quant=fused) as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        layer(sim.device.put(x))
        layer(sim.device.put(torch.cat([x, x], -1)), input_act="swiglu")
        dev = sim.device
        assert not dev.saw("aten::_int_mm")
        assert dev.of_kind("cpu_fallback") == [] and dev.of_kind("to_cpu") == []
        quant = "torch_npu.npu_rotate_quant" if fused else "torch_npu.npu_dynamic_quant"
        assert [e.name for e in dev.of_kind("kernel")] == [quant, "torch_npu.npu_quant_matmul"] * 2


def test_npu_fused_equals_unfused(data):
    q, s, x, _ = data
    h = torch.cat([x, x.flip(-1)], dim=-1)
    with simulated_npu() as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        hs = sim.device.put(h)
        fused = sim.device.fetch(layer(hs, input_act="swiglu"))
        plain = sim.device.fetch(layer(sim.device.put(swiglu(h))))
        assert sim.extras["module"].calls.count("npu_quant_matmul") == 2
    assert torch.equal(fused, plain)


def test_npu_static_admission_failure_dequantizes_on_the_npu():
    g = torch.Generator().manual_seed(6)
    q, s = quantize_weight(torch.randn(24, 40, generator=g), convrot=True, g=4)  # K=40: K % 16 != 0
    x = torch.randn(3, 40, generator=g, dtype=torch.bfloat16)
    with simulated_npu() as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, group_size=4, device="npu",
                                          probe=sim.probe)
        assert layer.backend_name == "dequant"
        assert "npu_quant_matmul: K=40 is not a multiple of 16" in layer.fallback_reason
        y = layer(sim.device.put(x))
        assert isinstance(y, SimTensor) and y.device.type == "npu"
        assert sim.device.of_kind("to_cpu") == [] and sim.extras["module"].calls == []
        assert not sim.device.saw("aten::_int_mm")
        y = sim.device.fetch(y)
    assert rel(y, reference_linear(x, q, s, True, 4)) < 0.01


def test_npu_call_admission_failure_dequantizes_on_the_npu(data):
    q, s, x, _ = data
    with simulated_npu() as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        y = layer(sim.device.put(x.float()))  # fp32 activation: npu_quant_matmul needs fp16/bf16
        assert layer.backend_name == "npu" and layer.runner.fallback_calls == 1
        assert "float32" in layer.runner.last_fallback_reason
        assert y.device.type == "npu" and y.dtype == torch.float32
        assert sim.extras["module"].calls == [] and sim.device.of_kind("to_cpu") == []
        y = sim.device.fetch(y)
    assert rel(y, reference_linear(x.float(), q, s, True, 256)) < 1e-5


def test_npu_layer_reasons_cover_the_spec():
    q = torch.zeros(8, 24, dtype=torch.int8)
    w = Int8Weights(q, torch.ones(3), torch.ones(3), torch.ones(5), True, 16)
    text = " | ".join(npu_layer_reasons(w))
    assert "K=24" in text and "scale holds 3" in text and "bias holds 5" in text and "group 16" in text


def test_npu_refuses_torch_int8_and_cpu_activations(data):
    q, s, x, _ = data
    with simulated_npu() as sim:
        with pytest.raises(DeviceError, match="silently runs on the CPU"):
            QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe,
                                      backend="torch-int8")
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        with pytest.raises(DeviceError, match="activation is on cpu"):
            layer(x)


def test_sim_torch_npu_fidelity():
    g = torch.Generator().manual_seed(7)
    with simulated_npu() as sim:
        npu: SimulatedTorchNpu = sim.extras["module"]
        put = sim.device.put
        x = torch.randn(5, 32, generator=g, dtype=torch.bfloat16)
        x[2] = 0
        qx, sx = npu.npu_dynamic_quant(put(x))
        assert qx.dtype == torch.int8 and sx.dtype == torch.float32 and sx.shape == (5,)
        qx_c, sx_c = sim.device.fetch(qx), sim.device.fetch(sx)
        amax = x.float().abs().amax(-1)
        assert torch.equal(sx_c, amax / 127) and sx_c[2] == 0 and qx_c[2].abs().sum() == 0
        assert qx_c.abs().amax() == 127
        with pytest.raises(RuntimeError, match="must be a tensor on npu"):
            npu.npu_dynamic_quant(x)
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            npu.npu_dynamic_quant(put(x.float()))
        with pytest.raises(RuntimeError, match="more than 1 dim"):
            npu.npu_dynamic_quant(put(x[0]))

        w = torch.randint(-128, 128, (32, 8), generator=g, dtype=torch.int8)  # [K, N]
        scale = torch.rand(8, generator=g) + 0.5
        pt = sx_c.clamp_min(1e-30)
        out = npu.npu_quant_matmul(qx, put(w), put(scale), pertoken_scale=put(pt),
                                   output_dtype=torch.bfloat16)
        acc = qx_c.long() @ w.long()
        expect = (acc.float() * scale[None, :] * pt[:, None]).to(torch.bfloat16)
        assert torch.equal(sim.device.fetch(out), expect)
        with pytest.raises(RuntimeError, match="must be a tensor on npu"):
            npu.npu_quant_matmul(qx, w, put(scale), pertoken_scale=put(pt), output_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="output_dtype float16 or bfloat16"):
            npu.npu_quant_matmul(qx, put(w), put(scale), pertoken_scale=put(pt))
        with pytest.raises(RuntimeError, match="bias must be"):
            npu.npu_quant_matmul(qx, put(w), put(scale), pertoken_scale=put(pt),
                                 bias=put(torch.zeros(8, dtype=torch.float16)), output_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="scale must be"):
            npu.npu_quant_matmul(qx, put(w), put(torch.ones(3)), pertoken_scale=put(pt),
                                 output_dtype=torch.bfloat16)
        # mixing devices fails as on hardware; _int_mm on npu tensors is the silent CPU fallback
        with pytest.raises(RuntimeError, match="same device"):
            put(x) + x
        torch._int_mm(put(torch.ones(32, 32, dtype=torch.int8)), put(torch.ones(32, 8, dtype=torch.int8)))
        assert [e.name for e in sim.device.of_kind("cpu_fallback")] == ["aten::_int_mm"]


# ---- MPS ---------------------------------------------------------------------------------------

def test_seed1_mps_fused_swiglu_never_reaches_int_mm(monkeypatch, data):
    q, s, x, bias = data
    h = torch.cat([x, x.flip(0)], dim=-1)

    def boom(*a, **k):
        raise AssertionError("fused SwiGLU reached torch._int_mm on MPS")

    monkeypatch.setattr(torch, "_int_mm", boom)
    with simulated_mps((2, 13)) as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias, device="mps", probe=sim.probe)
        assert layer.backend_name == "dequant"
        assert "no _int_mm before torch 2.15" in layer.fallback_reason
        fused = layer(sim.device.put(h), input_act="swiglu")
        assert fused.device.type == "mps"
        plain = layer(sim.device.put(swiglu(h)))
        assert not sim.device.saw("aten::_int_mm")
        fused, plain = sim.device.fetch(fused), sim.device.fetch(plain)
    assert torch.equal(fused, plain)
    assert rel(fused, reference_linear(swiglu(h.float()), q, s, True, 256, bias)) < 0.02


def test_mps_simulation_has_no_int_mm_before_torch_2_15(data):
    q, s, _, _ = data
    with simulated_mps((2, 13)) as sim:
        a = sim.device.put(torch.ones(32, 32, dtype=torch.int8))
        with pytest.raises(NotImplementedError, match="aten::_int_mm"):
            torch._int_mm(a, a)
        with pytest.raises(DeviceError, match="2.15"):
            QuantizedLinear.from_int8(q, s, convrot=True, device="mps", probe=sim.probe,
                                      backend="torch-int8")


def test_mps_with_int_mm_uses_it_on_the_fused_path(data):
    q, s, x, _ = data
    h = torch.cat([x, x], dim=-1)
    with simulated_mps((2, 15)) as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, device="mps", probe=sim.probe)
        assert layer.backend_name == "torch-int8"
        y = sim.device.fetch(layer(sim.device.put(h), input_act="swiglu"))
        assert "aten::_int_mm" in sim.device.ops(on_device=True)
    assert torch.equal(y, w8a8_emulation(swiglu(h), q, s, True, 256))
