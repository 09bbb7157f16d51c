"""``torch-int8``: ``torch._int_mm`` on devices whose table row and dispatcher both allow it
(CPU, CUDA, XPU >= 2.9, MPS >= 2.15). The device's shape gate (CUDA: M > 16, K % 8 == 0,
N % 8 == 0) is applied here: short ``M`` is zero-padded and sliced back; a ``K`` or ``N`` the gate
refuses makes ``admit`` fail, and selection falls back to ``dequant`` on the same device.
"""

from __future__ import annotations

import torch

from h3quant.errors import TpError
from h3quant.runtime.backends.base import Backend, Int8Weights, LinearOptions, Runner
from h3quant.runtime.capabilities import Capability, Probe, ShapeGate, int8_mm_capability
from h3quant.runtime.devices import Device
from h3quant.runtime.int8_math import add_bias, quantize_activation, scale_accumulator


def int_mm_padded(q_x: torch.Tensor, w_t: torch.Tensor, gate: ShapeGate) -> torch.Tensor:
    """``torch._int_mm(q_x, w_t)`` with ``q_x`` zero-padded to the gate's minimum rows."""
    m = q_x.shape[0]
    rows = gate.padded_m(m)
    if rows != m:
        pad = torch.zeros((rows - m, q_x.shape[1]), dtype=q_x.dtype, device=q_x.device)
        return torch._int_mm(torch.cat((q_x, pad), dim=0), w_t)[:m]
    return torch._int_mm(q_x, w_t)


class _TorchInt8Runner(Runner):
    name = "torch-int8"

    def __init__(self, w: Int8Weights, device: Device, gate: ShapeGate) -> None:
        super().__init__(w, device)
        self.gate = gate
        self.w_t = w.q.t()  # [K, N] view of the stored [N, K] bytes, no copy

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        lead = x.shape[:-1]
        q_x, s_x = quantize_activation(x, w.convrot, w.group_size)
        acc = int_mm_padded(q_x, self.w_t, self.gate)
        y = scale_accumulator(acc, s_x, w.scale_vec, x.dtype)
        return add_bias(y, w.bias).reshape(*lead, w.out_features)


class TorchInt8Backend(Backend):
    name = "torch-int8"
    summary = "torch._int_mm (int8 x int8 -> int32) with per-token activation scales"

    def status(self, device: Device, probe: Probe) -> Capability:
        return int8_mm_capability(device, probe)

    def admit(self, w: Int8Weights, device: Device, probe: Probe) -> list[str]:
        reasons = probe.shape_gate(device.kind).kn_reasons(w.in_features, w.out_features)
        return [f"{device.kind} _int_mm shape gate: {r}" for r in reasons]

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        return _TorchInt8Runner(w, device, probe.shape_gate(device.kind))

    def int32_matmul(self, device: Device, probe: Probe):

        cap = int8_mm_capability(device, probe)
        if not cap.available:
            raise TpError(f"shared activation scale needs an int8 x int8 -> int32 matmul on "
                          f"{device}: {'; '.join(cap.reasons)}; use --tp-scale per-rank")
        gate = probe.shape_gate(device.kind)

        def matmul(q_x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
            reasons = gate.kn_reasons(w_t.shape[0], w_t.shape[1])
            if reasons:
                raise TpError(f"{device} _int_mm refuses this shard ({'; '.join(reasons)}); use "
                              "--tp-scale per-rank or another tp degree")
            return int_mm_padded(q_x, w_t, gate)

        return matmul
