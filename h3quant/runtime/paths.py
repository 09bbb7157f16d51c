"""The runtime's default path for one encoded layer, for measurements that must use it.

A quality figure means something only on the path a format actually runs on: INT4 ConvRot with
its activations rotated and quantized to int4 (ComfyUI's eager W4A4 forward on the CPU), int8 and
W4A8 with int8 activations, the float formats (fp8, mxfp8, nvfp4, AWQ) through their decode to
the compute dtype. ``runtime_layer`` builds the module the runtime itself builds for a layer
(``runtime.model.block.quantized_linear``, what ``verify --model`` and the H3 forward use) from
the tensors a codec encoded, and ``layer_path`` says which path that module runs and what it does
to the activations. Benchmarks measure through these two functions and print the path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3quant.runtime.backends import DEQUANTIZED
from h3quant.runtime.devices import Device


@dataclass(frozen=True)
class LayerPath:
    """What runs a layer: the h3quant backend and what happens to its activations."""

    format: str  # the wire format name ("float" for an unquantized layer)
    backend: str  # torch-int8, emulated, dequant, float, ...
    activations: str  # e.g. "int8 per token", "int4 per token (rotated)", "float (bfloat16)"
    fallback: str | None = None  # why an int8 layer runs dequantized (None: it does not)

    def describe(self) -> str:
        text = f"{self.format}: {self.backend}, activations {self.activations}"
        return text if self.fallback is None else f"{text} (fallback: {self.fallback})"


def runtime_layer(tensors: dict[str, torch.Tensor], marker: dict | None, *,
                  bias: torch.Tensor | None = None, device: str | Device = "cpu",
                  compute_dtype: torch.dtype | None = None, name: str = "layer",
                  probe=None) -> torch.nn.Module:
    """The runtime module of a layer stored as ``tensors`` (a codec's ``encode`` output) under
    ``marker`` (None: a float layer, ``tensors["weight"]`` as is), built exactly as the runtime
    builds it for a loaded checkpoint, on its default backend for ``device``."""
    from h3quant.formats.markers import effective_fields
    from h3quant.runtime.loader import LoadedLayer
    from h3quant.runtime.model.block import quantized_linear

    t = dict(tensors)
    if bias is not None:
        t["bias"] = bias
    fields = None if marker is None else effective_fields(marker)
    layer = LoadedLayer(name, t, fields, "bench" if fields else None)
    return quantized_linear(layer, device=device, probe=probe, compute_dtype=compute_dtype)


def kernel_layer(tensors: dict[str, torch.Tensor], marker: dict, *, capability: tuple[int, int],
                 bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                 name: str = "layer") -> torch.nn.Module:
    """The layer as comfy-kitchen's CUDA kernels compute it on a GPU of compute ``capability``,
    emulated on the CPU, for a format whose codec routes by the GPU (``kernel_route``: INT4
    ConvRot, whose ``linear_dtype`` picks int4 or int8 activations there, while the CPU's eager
    path always rounds them to int4). ``layer_path`` names the route."""
    module = runtime_layer(tensors, marker, bias=bias, compute_dtype=compute_dtype, name=name)
    return on_kernel_route(module, capability)


# A GPU whose route runs a linear_dtype int8 INT4 ConvRot layer as every CUDA GPU does (int8
# activations) and an int4 one with int4 activations (sm_80: the int4 MMA).
A8_ROUTE = (8, 0)


def on_kernel_route(module: torch.nn.Module, capability: tuple[int, int]) -> torch.nn.Module:
    """``module`` (a runtime module of a format whose codec has ``kernel_route``) switched to
    the arithmetic of comfy-kitchen's kernels on a GPU of ``capability``, emulated."""
    from h3quant.runtime.decoded import DecodedLinear

    if not isinstance(module, DecodedLinear) or not hasattr(module.codec.emulator, "kernel_route"):
        raise ValueError(f"{module!r} has no emulated GPU kernel route")
    module.emulated, module.backend_name = True, "emulated"
    module.kernel_capability = (int(capability[0]), int(capability[1]))
    return module


def layer_path(module: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16,
               format_name: str | None = None) -> LayerPath:
    """The path ``module`` (from ``runtime_layer`` or the runtime's own loader) runs;
    ``format_name``: the layer's wire format (an int8 runtime module does not keep it)."""
    from h3quant.runtime.decoded import DecodedLinear
    from h3quant.runtime.linear import QuantizedLinear

    dt = str(compute_dtype).replace("torch.", "")
    if isinstance(module, DecodedLinear):
        fmt = module.codec.spec.name
        cap = module.kernel_capability
        if cap is not None:
            bits, runs = module.codec.emulator.kernel_route(module.fields, cap)
            return LayerPath(fmt, f"sm_{cap[0]}{cap[1]} kernel arithmetic (emulated)",
                             f"int{bits} per token (rotated; {runs})")
        if module.emulated:
            return LayerPath(fmt, "emulated", module.codec.spec.runtime.emulation[0])
        return LayerPath(fmt, "dequant", f"float ({dt}, the weight decoded to it)")
    if isinstance(module, QuantizedLinear):
        fmt = format_name or ("int8 ConvRot grid" if module.convrot else "int8 grid")
        name = module.backend_name
        if name not in DEQUANTIZED:  # an int8 kernel: the activations are quantized too
            rot = ", rotated" if module.convrot else ""
            return LayerPath(fmt, name, f"int8 per token{rot}")
        return LayerPath(fmt, name, f"float (weight dequantized to {dt})", module.fallback_reason)
    return LayerPath("float", "float", "float")


def path_for(target: str, k: int = 1024, n: int = 64, device: str | Device = "cpu",
             calibration=None) -> LayerPath:
    """The runtime's default path for a layer of conversion target ``target`` (``int4-convrot``,
    ``w4a8``, ...) of input width ``k`` on ``device``, found by encoding one random ``[n, k]``
    layer and building its runtime module. ``calibration``: statistics for a format that only
    writes calibrated (AWQ)."""
    from h3quant.formats import registry

    codec = registry.target_codec(target)
    marker = codec.spec.planning.marker(registry.target(target), group_size_for(k))
    if not marker:
        return LayerPath("float", "float", "float")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    tensors = codec.encoder.encode(w, marker, "exact", calibration=calibration)
    return layer_path(runtime_layer(tensors, marker, device=device), format_name=marker["format"])


def group_size_for(k: int, largest: int = 256) -> int:
    """The largest ConvRot group (a power of 4, at most ``largest``) that divides ``k``."""
    g = largest
    while g > 4 and k % g:
        g //= 4
    return g


__all__ = ["A8_ROUTE", "LayerPath", "group_size_for", "kernel_layer", "layer_path",
           "on_kernel_route", "path_for", "runtime_layer"]
