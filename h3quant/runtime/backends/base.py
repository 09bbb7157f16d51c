"""Backend interface: each backend says whether it can run on a device (and why not), whether it
admits a given layer, and binds a layer to a runner that computes ``y = x W^T + b``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3quant.runtime.capabilities import Capability, Probe
from h3quant.runtime.devices import Device
from h3quant.runtime.int8_math import apply_input_act, dequantize_weight


@dataclass(frozen=True)
class Int8Weights:
    """One int8_tensorwise layer, exact tensors already on the target device.

    ``q`` int8 ``[N, K]``; ``scale`` fp32 as stored (``[N, 1]``, ``[N]`` or ``[]``); ``scale_vec`` the same
    values flattened to ``[N]`` or ``[1]``; ``bias`` float ``[N]`` or None.
    """

    q: torch.Tensor
    scale: torch.Tensor
    scale_vec: torch.Tensor
    bias: torch.Tensor | None
    convrot: bool
    group_size: int

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]


@dataclass(frozen=True)
class LinearOptions:
    """Runtime options. ``compute_dtype``: dtype of a weight dequantized at load;
    ``dequant_cache``: keep that weight resident (else dequantize per call);
    ``dequant_budget_bytes``: dequantize per call instead when the resident copy would exceed it.
    """

    compute_dtype: torch.dtype = torch.bfloat16
    dequant_cache: bool = True
    dequant_budget_bytes: int | None = None


@dataclass(frozen=True)
class BackendStatus:
    """One row of ``list_backends``: ``reason`` is ``"ok"`` or every reason joined."""

    name: str
    available: bool
    reasons: tuple[str, ...]
    summary: str = ""

    @property
    def reason(self) -> str:
        return "ok" if self.available else "; ".join(self.reasons)


class Runner:
    """A layer bound to a backend. ``forward`` applies the input activation then ``matmul``."""

    name = "runner"

    def __init__(self, w: Int8Weights, device: Device) -> None:
        self.w = w
        self.device = device

    def forward(self, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        return self.matmul(apply_input_act(x, input_act))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K], activation dtype
        raise NotImplementedError


class Backend:
    """A way to run int8 linears. Subclasses set ``name``/``summary`` and override the hooks."""

    name = "backend"
    summary = ""

    def status(self, device: Device, probe: Probe) -> Capability:
        """Device-level: can this backend run on ``device`` at all?"""
        raise NotImplementedError

    def admit(self, w: Int8Weights, device: Device, probe: Probe) -> list[str]:
        """Layer-level: reasons this backend refuses the layer (empty: admitted)."""
        return []

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        raise NotImplementedError

    def int32_matmul(self, device: Device, probe: Probe):
        """A raw ``(q_x [M, K] int8, w_t [K, N] int8) -> int32 [M, N]`` matmul on ``device``
        (tensor parallel's shared-scale mode sums these partials across ranks), None when this
        backend has none; raises ``TpError`` when it has one that cannot run there."""
        return None


class DequantizedLinear:
    """A weight dequantized on its own device, resident or recomputed per call (``F.linear`` path)."""

    def __init__(self, w: Int8Weights, options: LinearOptions, *, resident: bool) -> None:
        self.w = w
        self.cached: torch.Tensor | None = None
        nbytes = w.q.numel() * torch.empty((), dtype=options.compute_dtype).element_size()
        budget = options.dequant_budget_bytes
        if resident and options.dequant_cache and (budget is None or nbytes <= budget):
            self.cached = self.weight(options.compute_dtype)

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.cached is not None and self.cached.dtype == dtype:
            return self.cached
        w = self.w
        return dequantize_weight(w.q, w.scale_vec, w.convrot, w.group_size, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.w.bias is None else self.w.bias.to(dtype=x.dtype)
        return torch.nn.functional.linear(x, self.weight(x.dtype), bias)
