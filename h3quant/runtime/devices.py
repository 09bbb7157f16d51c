"""Device strings parsed once into a small closed type.

``parse_device`` accepts ``cpu``, ``cuda[:N]``, ``mps``, ``npu[:N]``, ``xpu[:N]`` and ``auto``.
``auto`` asks a probe (``h3quant.runtime.probe``) in this order: CUDA (only through
``torch.cuda.is_available()``), Ascend NPU (``torch_npu`` importable and ``torch.npu.is_available()``),
XPU, MPS, CPU. ``torch.version.cuda`` is never consulted: NPU builds of torch carry one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
import torch

from h3quant.errors import DeviceError
from h3quant.runtime.probe import Probe, live_probe

DEVICE_KINDS = ("cpu", "cuda", "mps", "npu", "xpu")
_INDEXED = frozenset({"cuda", "npu", "xpu"})
_SPEC = re.compile(r"^(cpu|cuda|mps|npu|xpu)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A parsed device: ``kind`` in ``DEVICE_KINDS`` and an optional ``index``."""

    kind: str
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise DeviceError(f"unknown device kind {self.kind!r} (expected one of {', '.join(DEVICE_KINDS)})")
        if self.index is not None:
            if self.kind not in _INDEXED:
                raise DeviceError(f"device {self.kind!r} takes no index")
            if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
                raise DeviceError(f"device index must be a non-negative int, got {self.index!r}")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device``; ``npu`` needs ``torch_npu`` (or its simulation) imported first."""
        try:
            return torch.device(self.kind) if self.index is None else torch.device(self.kind, self.index)
        except RuntimeError as exc:
            raise DeviceError(
                f"this torch does not know device type {self.kind!r}"
                + (" (import torch_npu first)" if self.kind == "npu" else "")
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
        if spec.type not in DEVICE_KINDS:
            raise DeviceError(f"unsupported torch device type {spec.type!r}")
        return Device(spec.type, spec.index if spec.type in _INDEXED else None)
    if not isinstance(spec, str):
        raise DeviceError(f"device must be a string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text == "auto":
        return resolve_auto(probe)
    m = _SPEC.match(text)
    if m is None:
        raise DeviceError(
            f"invalid device {spec!r}: expected cpu, cuda[:N], mps, npu[:N], xpu[:N] or auto"
        )
    kind, index = m.group(1), m.group(2)
    if index is not None and kind not in _INDEXED:
        raise DeviceError(f"invalid device {spec!r}: {kind} takes no index")
    return Device(kind, int(index) if index is not None else None)


def resolve_auto(probe: Probe | None = None) -> Device:
    """The best available device, in the order CUDA, NPU, XPU, MPS, CPU."""
    if probe is None:
        probe = live_probe()
    if probe.cuda_available():
        return Device("cuda")
    if probe.npu_available():
        return Device("npu")
    if probe.xpu_available():
        return Device("xpu")
    if probe.mps_available():
        return Device("mps")
    return Device("cpu")


def device_of(t: torch.Tensor) -> Device:
    """The ``Device`` a tensor lives on."""
    return parse_device(t.device)
