"""Formats the runtime runs through their codec's decode (fp8, mxfp8 and any format whose codec
can decode but has no int8 grid).

This is what ComfyUI does on a device without the format's kernel: ``comfy/ops.py``'s
``MixedPrecisionOps.Linear`` falls back to ``forward_comfy_cast_weights``, which casts the
``QuantizedTensor`` weight to the compute dtype through its layout's ``dequantize`` (comfy-kitchen's
``dequantize_per_tensor_fp8`` / ``dequantize_mxfp8`` with ``orig_dtype`` = the compute dtype) and
runs a plain ``F.linear`` in that dtype. ``DecodedLinear`` does the same: the codec decodes the
stored tensors straight into the activation dtype (kitchen's order of operations and rounding),
on the layer's device, and a float matmul follows. Nothing here names a format: a new format
plugs in by giving its codec ``decode_weight``.

Where ComfyUI instead runs a format's emulated forward (comfy-kitchen's eager path, which also
quantizes the activations), the codec says so with ``emulation`` (what runs, on which device
kinds) and ``emulated_linear``; ``DecodedLinear`` then calls that on those devices (backend
``emulated``) and never builds the float weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h3quant.errors import DeviceError, FormatError
from h3quant.runtime.capabilities import Probe, live_probe
from h3quant.runtime.devices import Device, parse_device
from h3quant.runtime.int8_math import apply_input_act, check_input_act, input_act_width

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def decodes(codec) -> bool:
    """Whether the runtime runs layers of ``codec`` through its float decode."""
    return bool(codec.spec.runtime.decodes) and hasattr(codec.decoder, "decode_weight")


@dataclass(frozen=True)
class FormatRoute:
    """What runs layers of one format on a device, and why."""

    format: str
    runs: str  # the h3quant backend
    comfy: str  # what ComfyUI runs there
    reason: str


def emulates(codec, device: Device) -> bool:
    """Whether ComfyUI runs ``codec``'s emulated forward on ``device`` (so the runtime does)."""
    emulation = codec.spec.runtime.emulation  # (text, device kinds)
    return emulation is not None and device.kind in emulation[1]


def route(codec, device: Device, probe: Probe) -> FormatRoute:
    """The route of ``codec``'s layers on ``device`` (for ``backends`` and verify's notes)."""
    if emulates(codec, device):
        text = codec.spec.runtime.emulation[0]
        return FormatRoute(codec.spec.name, "emulated", text,
                           f"ComfyUI runs {text} on {device.kind}; h3quant runs the same "
                           "computation (the codec's emulated forward)")
    kernel = codec.spec.runtime.kernel  # (text, minimum CUDA capability) ComfyUI uses
    if device.kind == "cuda" and kernel is not None:
        cap = probe.cuda_capability(device.index)
        if cap is not None and tuple(cap) >= tuple(kernel[1]):
            return FormatRoute(codec.spec.name, "dequant", kernel[0],
                               f"ComfyUI runs {kernel[0]} on sm_{cap[0]}{cap[1]}; h3quant "
                               "dequantizes (the same weights, float matmul)")
        sm = f"sm_{kernel[1][0]}{kernel[1][1]}"
        have = "an unknown GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
        return FormatRoute(codec.spec.name, "dequant", "dequant",
                           f"{kernel[0]} needs {sm} or newer ({have}); ComfyUI dequantizes to "
                           "the compute dtype too")
    return FormatRoute(codec.spec.name, "dequant", "dequant",
                       f"no {codec.spec.name} kernel on {device.kind}; the weight is dequantized to "
                       "the compute dtype (comfy-kitchen's dequantize) and a float matmul runs")


class DecodedLinear(torch.nn.Module):
    """``y = act(x) W^T + b`` with ``W`` the codec's decode of the stored tensors, in ``x.dtype``;
    with ``emulated``, the codec's emulated forward of the stored tensors instead.

    The decoded weight is kept for the activation dtype it was last built for (one copy)."""

    def __init__(self, codec, tensors: dict, fields: dict | None, bias: torch.Tensor | None,
                 shape: tuple[int, int], device: Device, reason: str,
                 compute_dtype: torch.dtype = torch.bfloat16, *, emulated: bool = False) -> None:
        super().__init__()
        self.codec, self.fields, self.device = codec, fields, device
        self.fallback_reason = reason
        self.emulated = emulated
        self.kernel_capability: tuple[int, int] | None = None
        self.backend_name = "emulated" if emulated else "dequant"
        tdev = device.torch_device
        self._tensors = {s: t.to(tdev) for s, t in tensors.items() if s != "bias"}
        self.register_buffer("bias", None if bias is None else bias.to(tdev))
        self._shape = (int(shape[0]), int(shape[1]))
        self._cached: torch.Tensor | None = None
        if not emulated:
            self.weight_for(compute_dtype)

    @classmethod
    def from_layer(cls, layer, *, device="cpu", probe: Probe | None = None,
                   compute_dtype: torch.dtype | None = None) -> "DecodedLinear":
        """From a ``runtime.loader.LoadedLayer`` whose codec decodes."""
        probe = probe or live_probe()
        dev = device if isinstance(device, Device) else parse_device(device, probe=probe)
        codec = layer.codec
        if not decodes(codec):
            raise FormatError(f"{codec.spec.name} layers have no float decode", tensor=layer.name)
        r = route(codec, dev, probe)
        return cls(codec, layer.tensors, layer.fields, layer.bias,
                   (layer.out_features, layer.in_features), dev, r.reason,
                   compute_dtype or torch.bfloat16, emulated=emulates(codec, dev))

    @property
    def out_features(self) -> int:
        return self._shape[0]

    @property
    def in_features(self) -> int:
        return self._shape[1]

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        if self._cached is None or self._cached.dtype != dtype:
            self._cached = None  # drop the old copy before building the new one
            w = self.codec.decoder.decode_weight(self._tensors, self.fields, dtype)
            if tuple(w.shape) != self._shape:
                raise FormatError(f"decoded weight is {list(w.shape)}, expected "
                                  f"{list(self._shape)}")
            self._cached = w
        return self._cached

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        check_input_act(input_act)
        if not self.device.matches(x.device):
            raise DeviceError(f"activation is on {x.device}, layer lives on {self.device}")
        if x.dtype not in _FLOAT_DTYPES:
            raise FormatError(f"activation must be float16/bfloat16/float32, got {x.dtype}")
        width = self.in_features * input_act_width(input_act)
        if x.dim() < 1 or x.shape[-1] != width:
            raise FormatError(f"activation last dim {x.shape[-1] if x.dim() else None} != {width}")
        x = apply_input_act(x, input_act)
        bias = None if self.bias is None else torch.as_tensor(self.bias).to(x.dtype)
        if self.emulated:
            if self.kernel_capability is not None:  # a GPU kernel's arithmetic (paths.kernel_layer)
                return self.codec.emulator.emulated_linear(x, self._tensors, self.fields, bias,
                                                  capability=self.kernel_capability)
            return self.codec.emulator.emulated_linear(x, self._tensors, self.fields, bias)
        return F.linear(x, self.weight_for(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"format={self.codec.spec.name}, in_features={self.in_features}, "
                f"out_features={self.out_features}, device={self.device}, "
                f"backend={self.backend_name}")


def format_routes(device: str | Device = "auto", probe: Probe | None = None) -> list[FormatRoute]:
    """Per quantized format h3quant has a codec for: what runs its layers on ``device``."""
    from h3quant.formats import registry
    from h3quant.runtime.backends import PREFERENCE, list_backends

    probe = probe or live_probe()
    dev = parse_device(device, probe=probe)
    ok = {s.name for s in list_backends(dev, probe) if s.available}
    first = next((n for n in PREFERENCE.get(dev.kind, ()) if n in ok), "dequant")
    out = []
    for codec in registry.quantized_codecs():
        if codec.spec.alias_of:  # another name for a format listed under its own name
            continue
        if decodes(codec):
            out.append(route(codec, dev, probe))
        else:
            out.append(FormatRoute(codec.spec.name, first, "its int8 path",
                                   f"int8 grid: the first available int8 backend ({first}); "
                                   "a layer its kernel refuses runs dequant"))
    return out
