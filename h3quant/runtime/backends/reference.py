"""The specification backends: fp32 dequantized reference and an exact W8A8 emulation.

``reference_linear`` rotates the activation in fp32 and multiplies by the dequantized *rotated*
weight ``q.float() * s``: ``(x H)(W_rot)^T = x W^T`` because H_g is orthogonal. We chose this form
because the weight operand carries a single rounding (``q * s``) and no rotation; the ``dequant``
backend un-rotates the weight instead, so testing it against this reference cross-checks the
rotation from both sides.

``w8a8_emulation`` is FORMATS.md 3.2 step by step with the int32 accumulation computed exactly in
float64 (no ``_int_mm``): a kernel-free oracle for the int8 backends.
"""

from __future__ import annotations

import torch

from h3quant.runtime.backends.base import Backend, Int8Weights, LinearOptions, Runner
from h3quant.runtime.capabilities import Capability, Probe, device_capability
from h3quant.runtime.devices import Device
from h3quant.runtime.int8_math import quantize_activation, rotate_activation, scale_accumulator


def reference_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    convrot: bool,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``x W^T + b`` with ``W`` the dequantized weight (activation not quantized)."""
    xr = rotate_activation(x, convrot, group_size)
    w_rot = q.to(torch.float32) * s.to(torch.float32).reshape(-1, 1)
    y = xr @ w_rot.t()
    return y if bias is None else y + bias.to(torch.float32)


def w8a8_emulation(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    convrot: bool,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FORMATS.md 3.2 with an exact float64 integer accumulation; output in ``out_dtype`` (x's)."""
    out_dtype = out_dtype or x.dtype
    q_x, s_x = quantize_activation(x, convrot, group_size)
    acc = (q_x.to(torch.float64) @ q.to(torch.float64).t()).to(torch.int64)
    y = scale_accumulator(acc, s_x, s.reshape(-1), out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], q.shape[0])


class _ReferenceRunner(Runner):
    name = "reference"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        y = reference_linear(x, w.q, w.scale_vec, w.convrot, w.group_size, w.bias)
        return y.to(x.dtype)


class ReferenceBackend(Backend):
    name = "reference"
    summary = "fp32 dequantized weight x fp32 rotated activation (the specification; slow)"

    def status(self, device: Device, probe: Probe) -> Capability:
        return device_capability(device, probe)

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        return _ReferenceRunner(w, device)
