"""``kitchen``: comfy-kitchen's fused int8 linear (``comfy_kitchen.int8_linear``) on CUDA.

Optional: only offered on a CUDA device with ``comfy_kitchen`` importable and SM >= 7.5. Its
fused input activation is passed through, so the fused and plain calls still share this one
backend decision. Note: kitchen's eager fallback rotates and quantizes in the activation dtype,
while h3quant's own backends do both in fp32, so activation codes may differ by one at a few
positions between the two.
"""

from __future__ import annotations

import torch

from h3quant.runtime.backends.base import Backend, Int8Weights, LinearOptions, Runner
from h3quant.runtime.capabilities import Capability, Probe, device_capability
from h3quant.runtime.devices import Device

KITCHEN_MIN_SM = (7, 5)


class _KitchenRunner(Runner):
    name = "kitchen"

    def __init__(self, w: Int8Weights, device: Device, ck) -> None:
        super().__init__(w, device)
        self.ck = ck

    def forward(self, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        w = self.w
        return self.ck.int8_linear(
            x, w.q, w.scale, w.bias, x.dtype,
            convrot=w.convrot, convrot_groupsize=w.group_size,
            input_act=None if input_act == "none" else input_act,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x, None)


class KitchenBackend(Backend):
    name = "kitchen"
    summary = "comfy-kitchen fused CUDA int8 kernels (optional)"

    def status(self, device: Device, probe: Probe) -> Capability:
        if device.kind != "cuda":
            return Capability(False, (f"runs on CUDA only (device is {device.kind})",))
        reasons = list(device_capability(device, probe).reasons)
        if reasons:
            return Capability(False, tuple(reasons))
        ck, why = probe.kitchen_module()
        if ck is None:
            return Capability(False, (why,))
        if not hasattr(ck, "int8_linear"):
            return Capability(False, ("comfy_kitchen has no int8_linear",))
        sm = probe.cuda_capability(device.index)
        if sm is None or sm < KITCHEN_MIN_SM:
            return Capability(False, (f"int8 kernels need SM >= 7.5, device reports {sm}",))
        return Capability(True)

    def admit(self, w: Int8Weights, device: Device, probe: Probe) -> list[str]:
        # kitchen's CUDA kernels take the weight's data pointer as a row-major [N, K]; the
        # transpose view of a pre-transposed [K, N] weight (int8_tensorwise_kn) would be misread.
        if not w.q.is_contiguous():
            why = ("weight is the [N, K] view of a pre-transposed [K, N] tensor "
                   "(int8_tensorwise_kn); kitchen's kernels read a contiguous [N, K]")
            return [why]
        return []

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        return _KitchenRunner(w, device, probe.kitchen_module()[0])
