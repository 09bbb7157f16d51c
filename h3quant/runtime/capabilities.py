"""What each device can run, decided from a table plus the dispatcher, never by a trial call.

A trial call can "succeed" through a silent CPU fallback (``_int_mm`` on an Ascend NPU does), so
support for ``aten::_int_mm`` is: the device kind's table row allows it for this torch version AND
``torch._C._dispatch_has_kernel_for_dispatch_key(op, key)`` reports a kernel. All facts about the
running torch come from a ``Probe`` (``h3quant.runtime.probe``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from h3quant.runtime.devices import Device
from h3quant.runtime.probe import (
    CUDA_INT_MM_GATE,
    INT_MM_OP,
    INT_MM_SHAPE_GATES,
    NO_GATE,
    NPU_OPS,
    LiveProbe,
    Probe,
    ShapeGate,
    StaticProbe,
    dispatcher_has_kernel,
    live_probe,
    parse_torch_version,
)

@dataclass(frozen=True)
class OpRule:
    """One table row: on ``kind``, ``op`` runs natively from ``min_torch`` under ``dispatch_key``.

    ``dispatch_key=None`` means never use the op on that device (``note`` says why).
    """

    kind: str
    op: str
    dispatch_key: str | None
    min_torch: tuple[int, int] | None
    note: str


# aten::_int_mm per device kind (FORMATS.md section 6).
INT8_MM_TABLE: Mapping[str, OpRule] = {
    "cpu": OpRule("cpu", INT_MM_OP, "CPU", None, "native, no shape limits"),
    "cuda": OpRule("cuda", INT_MM_OP, "CUDA", None, "native (M > 16, K % 8 == 0, N % 8 == 0)"),
    "xpu": OpRule("xpu", INT_MM_OP, "XPU", (2, 9), "native since torch 2.9"),
    "mps": OpRule("mps", INT_MM_OP, "MPS", (2, 15), "no _int_mm before torch 2.15"),
    "npu": OpRule(
        "npu", INT_MM_OP, None, None,
        "aten::_int_mm silently runs on the CPU under torch_npu; use npu_quant_matmul",
    ),
}


@dataclass(frozen=True)
class Capability:
    """Whether something can run; ``reasons`` lists every reason it cannot (empty when it can)."""

    available: bool
    reasons: tuple[str, ...] = ()


def _capability(reasons: list[str]) -> Capability:
    return Capability(not reasons, tuple(reasons))


def device_capability(device: Device, probe: Probe) -> Capability:
    """Is the device itself present?"""
    if probe.device_available(device.kind):
        return Capability(True)
    if device.kind == "npu" and probe.npu_module() is None:
        return Capability(False, (f"device npu: {probe.npu_missing_reason()}",))
    return Capability(False, (f"device {device.kind} is not available to this torch",))


def int8_mm_capability(device: Device, probe: Probe) -> Capability:
    """Can ``aten::_int_mm`` run natively on ``device`` (table row + dispatcher kernel)?"""
    rule = INT8_MM_TABLE[device.kind]
    reasons = list(device_capability(device, probe).reasons)
    if rule.dispatch_key is None:
        reasons.append(f"{device.kind}: {rule.note}")
        return _capability(reasons)
    if rule.min_torch is not None and probe.torch_version < rule.min_torch:
        have = ".".join(map(str, probe.torch_version))
        reasons.append(f"{device.kind}: {rule.note} (this torch is {have})")
    if not probe.has_kernel(rule.op, rule.dispatch_key):
        reasons.append(f"dispatcher has no {rule.dispatch_key} kernel for {rule.op}")
    return _capability(reasons)


def npu_quant_capability(device: Device, probe: Probe) -> Capability:
    """Can ``torch_npu.npu_dynamic_quant`` + ``npu_quant_matmul`` run on ``device``?"""
    if device.kind != "npu":
        return Capability(False, (f"device is {device.kind}, not npu",))
    reasons = list(device_capability(device, probe).reasons)
    mod = probe.npu_module()
    if mod is not None:
        reasons += [f"torch_npu has no {op}" for op in NPU_OPS if not hasattr(mod, op)]
    return _capability(reasons)


__all__ = [
    "CUDA_INT_MM_GATE", "INT8_MM_TABLE", "INT_MM_OP", "INT_MM_SHAPE_GATES", "NO_GATE", "NPU_OPS",
    "Capability", "LiveProbe", "OpRule", "Probe", "ShapeGate", "StaticProbe", "device_capability",
    "dispatcher_has_kernel", "int8_mm_capability", "live_probe", "npu_quant_capability",
    "parse_torch_version",
]
