"""Device strings, auto resolution and the capability table (h3quant.runtime.devices/capabilities)."""

import pytest
import torch

from h3quant.errors import DeviceError
from h3quant.runtime.capabilities import (
    CUDA_INT_MM_GATE,
    INT8_MM_TABLE,
    INT_MM_OP,
    LiveProbe,
    StaticProbe,
    int8_mm_capability,
    npu_quant_capability,
    parse_torch_version,
)
from h3quant.runtime.devices import Device, device_of, parse_device, resolve_auto


@pytest.mark.parametrize(
    "text, kind, index",
    [("cpu", "cpu", None), ("cuda", "cuda", None), ("cuda:3", "cuda", 3), ("mps", "mps", None),
     ("npu", "npu", None), ("npu:1", "npu", 1), ("xpu", "xpu", None), ("xpu:0", "xpu", 0),
     (" CUDA:2 ", "cuda", 2)],
)
def test_parse_valid(text, kind, index):
    d = parse_device(text)
    assert (d.kind, d.index) == (kind, index)
    assert str(d) == (kind if index is None else f"{kind}:{index}")


@pytest.mark.parametrize("text", ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "mps:0", "cpu:0",
                                  "npu:1:2", "cuda0", "auto:1", "tpu"])
def test_parse_invalid_raises_device_error(text):
    with pytest.raises(DeviceError):
        parse_device(text)


def test_parse_non_string_and_frozen():
    with pytest.raises(DeviceError):
        parse_device(3)
    d = parse_device("cuda:1")
    with pytest.raises(Exception):
        d.kind = "cpu"
    assert parse_device(d) is d
    assert parse_device(torch.device("cpu")) == Device("cpu")
    assert parse_device(torch.device("cuda", 2)) == Device("cuda", 2)
    with pytest.raises(DeviceError):
        Device("tpu")
    with pytest.raises(DeviceError):
        Device("mps", 0)


def test_torch_device_and_matches():
    assert Device("cuda", 1).torch_device == torch.device("cuda", 1)
    assert Device("cpu").torch_device == torch.device("cpu")
    assert device_of(torch.zeros(1)) == Device("cpu")
    assert Device("cuda").matches(torch.device("cuda", 3))
    assert not Device("cuda", 1).matches(torch.device("cuda", 0))
    assert not Device("cpu").matches(torch.device("meta"))


def _probe(**kw):
    return StaticProbe(name="test", **kw)


@pytest.mark.parametrize(
    "facts, expected",
    [({}, "cpu"), ({"mps": True}, "mps"), ({"xpu": True, "mps": True}, "xpu"),
     ({"npu": object(), "npu_device": True, "xpu": True}, "npu"),
     ({"cuda": True, "npu": object(), "npu_device": True}, "cuda"),
     ({"npu": object(), "npu_device": False}, "cpu")],
)
def test_auto_order(facts, expected):
    assert resolve_auto(_probe(**facts)).kind == expected
    assert parse_device("auto", probe=_probe(**facts)).kind == expected


def test_auto_ignores_cuda_version_string():
    # NPU builds of torch carry torch.version.cuda: it must never mean "NVIDIA".
    probe = _probe(cuda_version="12.1", cuda=False)
    assert resolve_auto(probe).kind == "cpu"
    probe = _probe(cuda_version="12.1", cuda=False, npu=object(), npu_device=True)
    assert resolve_auto(probe).kind == "npu"


def test_live_auto_on_this_machine_uses_is_available(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert resolve_auto(LiveProbe()).kind in ("cpu", "mps", "xpu")
    assert calls, "auto must ask torch.cuda.is_available()"


def test_torch_version_parse():
    assert parse_torch_version("2.13.0+cpu") == (2, 13)
    assert parse_torch_version("2.9.1") == (2, 9)
    with pytest.raises(ValueError):
        parse_torch_version("nightly")


def test_table_rows_match_spec():
    assert INT8_MM_TABLE["npu"].dispatch_key is None
    assert INT8_MM_TABLE["mps"].min_torch == (2, 15)
    assert INT8_MM_TABLE["xpu"].min_torch == (2, 9)
    assert INT8_MM_TABLE["cpu"].dispatch_key == "CPU"
    assert INT8_MM_TABLE["cuda"].dispatch_key == "CUDA"


ALL_KERNELS = frozenset((INT_MM_OP, k) for k in ("CPU", "CUDA", "XPU", "MPS"))


@pytest.mark.parametrize(
    "kind, facts, ok",
    [
        ("cpu", {}, True),
        ("cpu", {"kernels": frozenset()}, False),  # dispatcher says no kernel
        ("mps", {"mps": True, "torch_version": (2, 13)}, False),  # table: MPS only from 2.15
        ("mps", {"mps": True, "torch_version": (2, 15)}, True),
        ("mps", {"mps": True, "torch_version": (2, 15), "kernels": frozenset({(INT_MM_OP, "CPU")})}, False),
        ("xpu", {"xpu": True, "torch_version": (2, 8)}, False),
        ("xpu", {"xpu": True, "torch_version": (2, 9)}, True),
        ("cuda", {"cuda": False, "cuda_version": "12.1"}, False),
        ("cuda", {"cuda": True}, True),
        ("npu", {"npu": object(), "npu_device": True}, False),  # never, even with kernels present
    ],
)
def test_int8_mm_capability(kind, facts, ok):
    facts = {"kernels": ALL_KERNELS, **facts}
    cap = int8_mm_capability(Device(kind), _probe(**facts))
    assert cap.available is ok
    assert bool(cap.reasons) is (not ok)


def test_capability_lists_every_reason():
    cap = int8_mm_capability(Device("mps"), _probe(torch_version=(2, 13), kernels=frozenset()))
    text = " | ".join(cap.reasons)
    assert "not available" in text and "2.15" in text and "no MPS kernel" in text


def test_capability_is_not_a_trial_call(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("capability detection must not call the op")

    monkeypatch.setattr(torch, "_int_mm", boom)
    assert int8_mm_capability(Device("cpu"), LiveProbe()).available
    assert LiveProbe().has_kernel(INT_MM_OP, "CPU")
    assert not LiveProbe().has_kernel("aten::definitely_not_an_op", "CPU")


def test_npu_capability_reasons():
    assert not npu_quant_capability(Device("cpu"), _probe()).available
    cap = npu_quant_capability(Device("npu"), _probe())
    assert not cap.available and "torch_npu" in cap.reasons[0]

    class Partial:
        def npu_dynamic_quant(self, x):
            return x

    cap = npu_quant_capability(Device("npu"), _probe(npu=Partial(), npu_device=True))
    assert cap.reasons == ("torch_npu has no npu_quant_matmul",)


def test_cuda_gate():
    g = CUDA_INT_MM_GATE
    assert [g.padded_m(m) for m in (1, 16, 17, 100)] == [32, 32, 17, 100]
    assert g.kn_reasons(64, 64) == []
    assert len(g.kn_reasons(60, 20)) == 2
    assert StaticProbe(shape_gates={"cpu": g}).shape_gate("cpu") is g
    assert LiveProbe().shape_gate("cuda") is g
    assert LiveProbe().shape_gate("cpu").padded_m(1) == 1


def test_a_device_index_beyond_the_machine_is_refused_before_any_work():
    """``cuda:1`` on a one-GPU machine is a usage error naming the devices there are."""
    from h3quant.errors import DeviceError
    from h3quant.runtime.availability import require_device
    from h3quant.runtime.probe import StaticProbe

    one_gpu = StaticProbe(cuda=True, counts={"cuda": 1})
    assert str(require_device("cuda:0", probe=one_gpu)) == "cuda:0"
    assert str(require_device("cuda", probe=one_gpu)) == "cuda"
    with pytest.raises(DeviceError, match=r"cuda:1: this machine has 1 cuda device\(s\) \(cuda:0\)"):
        require_device("cuda:1", probe=one_gpu)
    unknown = StaticProbe(cuda=True)  # a probe that cannot count accepts the index
    assert str(require_device("cuda:7", probe=unknown)) == "cuda:7"
