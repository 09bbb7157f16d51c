"""``QuantizedLinear``: an int8_tensorwise (+ ConvRot) linear built from the exact file tensors.

The backend is chosen ONCE, when the layer is built, and both ``forward(x)`` and the fused
``forward(x, input_act="swiglu")`` go through that same runner: the fused call applies the
activation eagerly and then takes exactly the path of the plain call (so a device without an
int8 kernel never reaches ``_int_mm`` through the fused call). Output
dtype is the activation dtype. The layer stays on the device it was built for.
"""

from __future__ import annotations

import torch

from h3quant.convrot import is_valid_group_size
from h3quant.errors import DeviceError, FormatError
from h3quant.runtime.backends import (
    Int8Weights,
    LinearOptions,
    Selection,
    bind_backend,
    select_backend,
)
from h3quant.runtime.capabilities import Probe, live_probe
from h3quant.runtime.devices import Device, parse_device
from h3quant.runtime.int8_math import check_input_act, input_act_width, row_scales

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensors(q, scale, bias, convrot: bool, group_size: int) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        raise FormatError(f"weight must be an int8 [N, K] tensor, got {_desc(q)}")
    n, k = q.shape
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise FormatError(f"weight_scale must be a float32 tensor, got {_desc(scale)}")
    if tuple(scale.shape) not in ((n, 1), (n,), (), (1,)):
        raise FormatError(f"weight_scale shape {tuple(scale.shape)} is not [N, 1], [N] or [] for N={n}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in _FLOAT_DTYPES:
            raise FormatError(f"bias must be a float tensor, got {_desc(bias)}")
        if tuple(bias.shape) != (n,):
            raise FormatError(f"bias shape {tuple(bias.shape)} is not [N] = [{n}]")
    if convrot:
        if not is_valid_group_size(group_size):
            raise FormatError(f"ConvRot group size must be a power of 4 (4..1024), got {group_size!r}")
        if k % group_size:
            raise FormatError(f"ConvRot group size {group_size} does not divide K={k}")


def _to_device(q: torch.Tensor, tdev: torch.device) -> torch.Tensor:
    """``q`` on ``tdev`` in one move, keeping its memory layout: the ``[N, K]`` transpose view of
    a pre-transposed ``[K, N]`` weight (int8_tensorwise_kn) moves as that contiguous ``[K, N]``
    tensor and stays a view, so the NPU can take it as is."""
    if not q.is_contiguous() and q.t().is_contiguous():
        return q.t().to(tdev).t()
    return q.to(tdev)


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return type(t).__name__


class QuantizedLinear(torch.nn.Module):
    """int8 W8A8 linear. Build with ``QuantizedLinear.from_int8``; see ``backend_name``."""

    weight: torch.Tensor  # buffers (declared for the type checker)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weights: Int8Weights,
        device: Device,
        selection: Selection,
        probe: Probe,
        options: LinearOptions,
        full_precision: bool,
    ) -> None:
        super().__init__()
        self.convrot = weights.convrot
        self.group_size = weights.group_size
        self.full_precision = full_precision
        self.device = device
        self.selection = selection
        self.options = options
        self._runner = bind_backend(weights, selection, probe, options)
        # A runner may hold the weight in a device format of its own (the NPU's FRACTAL_NZ cast
        # of a pre-transposed weight): keep only its tensors, so no second copy stays alive.
        weights = getattr(self._runner, "w", weights)
        self._weights = weights
        self.register_buffer("weight", weights.q)
        self.register_buffer("weight_scale", weights.scale)
        self.register_buffer("bias", weights.bias)

    @classmethod
    def from_int8(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        *,
        convrot: bool,
        group_size: int = 256,
        bias: torch.Tensor | None = None,
        full_precision: bool = False,
        device: str | Device | torch.device = "cpu",
        backend: str | None = None,
        probe: Probe | None = None,
        options: LinearOptions | None = None,
    ) -> "QuantizedLinear":
        """Build from exact tensors: int8 ``q [N, K]``, fp32 ``scale`` ``[N, 1]``/``[N]``/``[]``.
        ``q`` may be the ``.t()`` view of a pre-transposed ``[K, N]`` weight (int8_tensorwise_kn):
        it then moves to the device as that contiguous tensor, still without a copy on the device.

        Bytes and scales are copied to ``device`` unchanged (no re-quantization). ``backend``
        forces one backend (``DeviceError`` if it cannot run there); ``probe`` injects the facts
        about torch and the machine (tests, simulations).
        """
        probe = probe or live_probe()
        _check_tensors(q, scale, bias, convrot, group_size)
        dev = parse_device(device, probe=probe)
        tdev = dev.torch_device
        q_d = _to_device(q, tdev)
        s_d = scale.to(tdev)
        b_d = None if bias is None else bias.to(tdev)
        w = Int8Weights(q_d, s_d, row_scales(s_d, q.shape[0]), b_d, bool(convrot), int(group_size))
        selection = select_backend(
            w, dev, probe, requested=backend, full_precision=full_precision
        )
        return cls(w, dev, selection, probe, options or LinearOptions(), full_precision)

    @property
    def backend_name(self) -> str:
        """The backend this layer runs (``torch-int8``, ``npu``, ``dequant``, ...)."""
        return self._runner.name

    @property
    def fallback_reason(self) -> str | None:
        """Why the layer runs dequantized instead of an int8 kernel (None if it does not)."""
        return self.selection.fallback_reason

    @property
    def runner(self):
        return self._runner

    @property
    def in_features(self) -> int:
        return self._weights.in_features

    @property
    def out_features(self) -> int:
        return self._weights.out_features

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        """``y = act(x) W^T + b`` in ``x.dtype``; ``input_act``: None or ``"swiglu"``."""
        check_input_act(input_act)
        if not self.device.matches(x.device):
            raise DeviceError(f"activation is on {x.device}, layer lives on {self.device}")
        if not self.device.matches(self.weight.device):
            raise DeviceError(
                f"layer was moved to {self.weight.device} after it was built for {self.device}; "
                "rebuild it with from_int8(device=...)"
            )
        if x.dtype not in _FLOAT_DTYPES:
            raise FormatError(f"activation must be float16/bfloat16/float32, got {x.dtype}")
        width = self.in_features * input_act_width(input_act)
        if x.dim() < 1 or x.shape[-1] != width:
            raise FormatError(
                f"activation last dim {x.shape[-1] if x.dim() else None} != {width}"
                + (" (swiglu input is [gate | up] = 2K)" if input_act == "swiglu" else "")
            )
        if x.numel() == 0:
            return torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
        return self._runner.forward(x, input_act)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"convrot={self.convrot}, group_size={self.group_size}, device={self.device}, "
            f"backend={self.backend_name}"
        )
