"""QuantizedLinear: one dispatch decision shared by the plain and the fused SwiGLU call."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from h3quant.errors import DeviceError
from h3quant.runtime.backends import reference_linear
from h3quant.runtime.capabilities import StaticProbe
from h3quant.runtime.linear import QuantizedLinear
from helpers.runtime import quantize_weight, rel


class RecordOps(TorchDispatchMode):
    """Records every aten op name that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))




@pytest.fixture
def fc2():
    g = torch.Generator().manual_seed(3)
    f = 256  # fc2 input width F; the fused input is [gate | up] = 2F
    q, s = quantize_weight(torch.randn(32, f, generator=g))
    h = torch.randn(3, 5, 2 * f, generator=g, dtype=torch.bfloat16)
    return q, s, h


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("backend", [None, "torch-int8", "dequant", "reference"])
def test_fused_equals_unfused(fc2, backend):
    q, s, h = fc2
    layer = QuantizedLinear.from_int8(q, s, convrot=True, backend=backend)
    fused = layer(h, input_act="swiglu")
    plain = layer(swiglu(h))
    assert fused.shape == (3, 5, 32) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, plain)
    ref = reference_linear(swiglu(h.float()), q, s, True, 256)
    assert rel(fused, ref) < 0.02


def test_fused_path_uses_int_mm_where_it_exists(fc2):
    q, s, h = fc2
    layer = QuantizedLinear.from_int8(q, s, convrot=True)
    assert layer.backend_name == "torch-int8"
    with RecordOps() as rec:
        layer(h, input_act="swiglu")
    assert rec.ops.count("aten::_int_mm") == 1
    with RecordOps() as rec:
        layer(swiglu(h))
    assert rec.ops.count("aten::_int_mm") == 1


def test_fused_path_without_int8_matmul_never_reaches_int_mm(fc2, monkeypatch):
    # The fused call honours the fallback on CPU terms: a device whose profile has no _int_mm kernel.
    q, s, h = fc2
    no_int_mm = StaticProbe(name="cpu-without-int-mm", kernels=frozenset())
    layer = QuantizedLinear.from_int8(q, s, convrot=True, probe=no_int_mm)
    assert layer.backend_name == "dequant"
    assert "no CPU kernel for aten::_int_mm" in layer.fallback_reason

    def boom(*a, **k):
        raise AssertionError("reached torch._int_mm")

    monkeypatch.setattr(torch, "_int_mm", boom)
    with RecordOps() as rec:
        fused = layer(h, input_act="swiglu")
    assert "aten::_int_mm" not in rec.ops
    assert torch.equal(fused, layer(swiglu(h)))


def test_decision_is_made_once(fc2):
    q, s, h = fc2
    layer = QuantizedLinear.from_int8(q, s, convrot=True)
    runner = layer.runner
    layer(h, input_act="swiglu")
    layer(swiglu(h))
    assert layer.runner is runner and layer.backend_name == "torch-int8"
    assert "backend=torch-int8" in repr(layer)


def test_bytes_are_exact_and_state_dict_names(fc2):
    q, s, _ = fc2
    bias = torch.randn(32, dtype=torch.bfloat16)
    layer = QuantizedLinear.from_int8(q, s, convrot=True, bias=bias)
    sd = layer.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert torch.equal(sd["weight"], q) and sd["weight"].dtype == torch.int8
    assert torch.equal(sd["weight_scale"], s) and sd["weight_scale"].shape == (32, 1)
    assert torch.equal(sd["bias"], bias) and sd["bias"].dtype == torch.bfloat16
    assert layer.in_features == 256 and layer.out_features == 32


def test_layer_moved_after_build_is_refused(fc2):
    q, s, h = fc2
    layer = QuantizedLinear.from_int8(q, s, convrot=True)
    layer.to("meta")
    with pytest.raises(DeviceError, match="moved"):
        layer(h)
