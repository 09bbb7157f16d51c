"""``dequant``: for devices without an int8 matmul (MPS before torch 2.15, full-precision layers,
shapes a kernel refuses). The weight is dequantized ON the layer's device (resident, or per call
under a memory budget) and a plain ``F.linear`` runs in the activation dtype.
"""

from __future__ import annotations

import torch

from h3quant.runtime.backends.base import (
    Backend,
    DequantizedLinear,
    Int8Weights,
    LinearOptions,
    Runner,
)
from h3quant.runtime.capabilities import Capability, Probe, device_capability
from h3quant.runtime.devices import Device


class _DequantRunner(Runner):
    name = "dequant"

    def __init__(self, w: Int8Weights, device: Device, options: LinearOptions) -> None:
        super().__init__(w, device)
        self.linear = DequantizedLinear(w, options, resident=True)

    @property
    def resident(self) -> bool:
        return self.linear.cached is not None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class DequantBackend(Backend):
    name = "dequant"
    summary = "dequantize the weight on the device, plain matmul in the activation dtype"

    def status(self, device: Device, probe: Probe) -> Capability:
        return device_capability(device, probe)

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        return _DequantRunner(w, device, options)
