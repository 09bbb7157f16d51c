"""One record per device kind: everything h3quant decides by the kind of a device.

A new device kind is a record in ``KINDS`` (and, for ``auto`` and ``backends``, an availability
question in ``h3quant.runtime.probe``). Code elsewhere asks the record (``kind("npu").collective``,
``kind(dev.kind).compute_dtype``) instead of testing the kind's name; a test keeps the names
inside the device modules.

Importing this module needs no torch (the CLI builds its help texts from it); the methods that
act on a device import torch when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3quant.errors import DeviceError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceKind:
    """A kind of device, as the ``--device`` string names it."""

    name: str  # the device string's kind, torch's device type
    label: str  # for people
    indexed: bool  # takes ``:N``
    collective: str | None  # torch.distributed backend for tensor parallel; None: TP cannot run
    compute: str  # the activation dtype of the quantized runtime (a torch dtype's name)
    torch_module: str | None  # torch's per-device module (set_device, synchronize); None: the host
    package: str | None = None  # the package that registers the kind with torch
    auto_rank: int | None = None  # position in ``auto``'s search (lower first); None: fallback
    float64: bool = True  # tensors of float64 can live on it (MPS has none)

    @property
    def spec(self) -> str:
        """How a device string names this kind: ``cuda[:N]``, ``mps``."""
        return f"{self.name}[:N]" if self.indexed else self.name

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations run in on this kind (the reference always runs float32)."""
        import torch

        dtype = getattr(torch, self.compute)
        assert isinstance(dtype, torch.dtype), self.compute
        return dtype

    def module(self):
        """torch's module for this kind (``torch.cuda``), importing ``package`` first; DeviceError
        when that package is missing. None for the host."""
        if self.torch_module is None:
            return None
        if self.package is not None:
            try:
                importlib.import_module(self.package)
            except ImportError:
                raise DeviceError(f"device {self.name} needs {self.package}, which is not "
                                  "installed") from None
        import torch

        return getattr(torch, self.torch_module, None)

    def set_device(self, index: int) -> None:
        """Make device ``index`` of this kind the current one (a rank's own device)."""
        mod = self.module()
        if mod is not None and self.indexed:
            mod.set_device(index)

    def sync(self) -> None:
        """Wait for the work queued on this kind's devices (for timing); a no-op on the host or
        where torch has no such device."""
        if self.torch_module is None:
            return
        try:
            mod = self.module()
        except DeviceError:
            return
        available = getattr(mod, "is_available", None)
        synchronize = getattr(mod, "synchronize", None)
        if synchronize is not None and (available is None or available()):
            synchronize()

    def device_count(self) -> int:
        """How many devices of this kind torch sees (1 for the host)."""
        if self.torch_module is None:
            return 1
        try:
            mod = self.module()
        except DeviceError:
            return 0
        count = getattr(mod, "device_count", None)
        return int(count()) if count is not None else 0


# In the order messages list them.
KINDS: tuple[DeviceKind, ...] = (
    DeviceKind("cpu", "CPU", False, "gloo", "float32", None),
    DeviceKind("cuda", "CUDA", True, "nccl", "bfloat16", "cuda", auto_rank=0),
    DeviceKind("mps", "MPS", False, None, "bfloat16", "mps", auto_rank=3, float64=False),
    DeviceKind("npu", "Ascend NPU", True, "hccl", "bfloat16", "npu", package="torch_npu",
               auto_rank=1),
    DeviceKind("xpu", "XPU", True, None, "bfloat16", "xpu", auto_rank=2),
)
_BY_NAME = {k.name: k for k in KINDS}
HOST = next(k for k in KINDS if k.torch_module is None)


def names() -> tuple[str, ...]:
    """Every kind's name, in ``KINDS`` order."""
    return tuple(_BY_NAME)


def kind(name: str) -> DeviceKind:
    """The record of ``name``; DeviceError naming the known kinds otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise DeviceError(f"unknown device kind {name!r} (expected one of "
                          f"{', '.join(_BY_NAME)})") from None


def auto_order() -> tuple[DeviceKind, ...]:
    """The kinds ``auto`` tries, best first (the host is the fallback, not tried)."""
    return tuple(sorted((k for k in KINDS if k.auto_rank is not None),
                        key=lambda k: k.auto_rank or 0))


def collectives() -> dict[str, str]:
    """Kind -> torch.distributed backend, for the kinds tensor parallel runs on."""
    return {k.name: k.collective for k in KINDS if k.collective is not None}


def _listing(items: list[str], last: str = "or") -> str:
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else "".join(items)


def device_help(*, auto: bool = True) -> str:
    """The device strings, for help texts and errors: ``auto, cpu, cuda[:N], mps, npu[:N] or
    xpu[:N]``."""
    return _listing((["auto"] if auto else []) + [k.spec for k in KINDS])


def collective_help() -> str:
    """``cpu (gloo), cuda (nccl) or npu (hccl)``: where tensor parallel runs."""
    return _listing([f"{name} ({backend})" for name, backend in collectives().items()])
