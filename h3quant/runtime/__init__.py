"""Runtime: devices, capability probes, int8 linear backends and the quantized linear module.

Simulations of hardware we lack live in ``h3quant.testing`` and are never imported here.
"""

from h3quant.runtime.backends import (
    BackendStatus,
    LinearOptions,
    list_backends,
    reference_linear,
    select_backend,
    w8a8_emulation,
)
from h3quant.runtime.capabilities import (
    INT8_MM_TABLE,
    Capability,
    LiveProbe,
    Probe,
    StaticProbe,
    int8_mm_capability,
    live_probe,
    npu_quant_capability,
)
from h3quant.runtime.devices import Device, device_of, parse_device, resolve_auto
from h3quant.runtime.linear import QuantizedLinear

__all__ = [
    "INT8_MM_TABLE",
    "BackendStatus",
    "Capability",
    "Device",
    "LinearOptions",
    "LiveProbe",
    "Probe",
    "QuantizedLinear",
    "StaticProbe",
    "device_of",
    "int8_mm_capability",
    "list_backends",
    "live_probe",
    "npu_quant_capability",
    "parse_device",
    "reference_linear",
    "resolve_auto",
    "select_backend",
    "w8a8_emulation",
]
