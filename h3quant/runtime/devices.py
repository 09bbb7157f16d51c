"""Device strings parsed once into a small closed type.

``parse_device`` accepts the kinds of ``h3quant.device_kinds`` (``cpu``, ``cuda[:N]``, ``mps``,
``npu[:N]``, ``xpu[:N]``) and ``auto``. ``auto`` asks a probe (``h3quant.runtime.probe``) for
each kind in the records' order: CUDA (only through ``torch.cuda.is_available()``), Ascend NPU
(``torch_npu`` importable and ``torch.npu.is_available()``), XPU, MPS, else CPU.
``torch.version.cuda`` is never consulted: NPU builds of torch carry one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
import torch

from h3quant import device_kinds
from h3quant.device_kinds import DeviceKind
from h3quant.errors import DeviceError
from h3quant.runtime.probe import Probe, live_probe

DEVICE_KINDS = device_kinds.names()  # the kinds' names (the records are the source)
_SPEC = re.compile(r"^([a-z]+)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A parsed device: ``kind``, a kind of ``h3quant.device_kinds``, and an optional ``index``."""

    kind: str
    index: int | None = None

    def __post_init__(self) -> None:
        record = device_kinds.kind(self.kind)  # DeviceError naming the known kinds
        if self.index is not None:
            if not record.indexed:
                raise DeviceError(f"device {self.kind!r} takes no index")
            if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
                raise DeviceError(f"device index must be a non-negative int, got {self.index!r}")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def record(self) -> DeviceKind:
        """Everything decided by this device's kind (``h3quant.device_kinds``)."""
        return device_kinds.kind(self.kind)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activation dtype of the quantized runtime here (the reference runs float32)."""
        return self.record.compute_dtype

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device``; ``npu`` needs ``torch_npu`` (or its simulation) imported first."""
        try:
            return torch.device(self.kind) if self.index is None else torch.device(self.kind, self.index)
        except RuntimeError as exc:
            package = self.record.package
            raise DeviceError(
                f"this torch does not know device type {self.kind!r}"
                + (f" (import {package} first)" if package else "")
                + f": {exc}"
            ) from exc

    def matches(self, dev: torch.device) -> bool:
        """True when a tensor on ``dev`` lives on this device (a missing index matches any)."""
        if dev.type != self.kind:
            return False
        return self.index is None or dev.index is None or dev.index == self.index


def parse_device(spec: str | Device | torch.device, *, probe: Probe | None = None) -> Device:
    """Parse a device string once; ``auto`` is resolved through ``probe`` (live torch by default)."""
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, torch.device):
        if spec.type not in device_kinds.names():
            raise DeviceError(f"unsupported torch device type {spec.type!r}")
        return Device(spec.type, spec.index if device_kinds.kind(spec.type).indexed else None)
    if not isinstance(spec, str):
        raise DeviceError(f"device must be a string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text == "auto":
        return resolve_auto(probe)
    m = _SPEC.match(text)
    if m is None or m.group(1) not in device_kinds.names():
        raise DeviceError(f"invalid device {spec!r}: expected {device_kinds.device_help()}")
    kind, index = m.group(1), m.group(2)
    if index is not None and not device_kinds.kind(kind).indexed:
        raise DeviceError(f"invalid device {spec!r}: {kind} takes no index")
    return Device(kind, int(index) if index is not None else None)


def resolve_auto(probe: Probe | None = None) -> Device:
    """The best available device, in the records' order (CUDA, NPU, XPU, MPS), else the host."""
    if probe is None:
        probe = live_probe()
    for k in device_kinds.auto_order():
        if probe.device_available(k.name):
            return Device(k.name)
    return Device(device_kinds.HOST.name)


def device_of(t: torch.Tensor) -> Device:
    """The ``Device`` a tensor lives on."""
    return parse_device(t.device)
