"""Facts about the running torch and machine, asked through a ``Probe`` (never a trial call).

``LiveProbe`` asks the torch of this process, ``StaticProbe`` holds fixed answers so tests can
simulate torches and machines we do not have. Nothing here knows about ``Device`` objects, so
``devices`` (which resolves ``auto`` through a probe) and ``capabilities`` (which combines a probe
with the per-device op table) both build on this module without importing each other.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Mapping

import torch

INT_MM_OP = "aten::_int_mm"
NPU_OPS = ("npu_dynamic_quant", "npu_quant_matmul")


def parse_torch_version(text: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot parse torch version {text!r}")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class ShapeGate:
    """Shape limits of an int8 matmul kernel: ``M`` is padded up, ``K``/``N`` must be multiples."""

    min_m: int = 0
    k_multiple: int = 1
    n_multiple: int = 1
    pad_m_to: int = 0

    def padded_m(self, m: int) -> int:
        """Rows to run with: ``m`` itself, or ``pad_m_to`` when ``m < min_m``."""
        return m if m >= self.min_m else max(self.pad_m_to, self.min_m)

    def kn_reasons(self, k: int, n: int) -> list[str]:
        out = []
        if k % self.k_multiple:
            out.append(f"K={k} is not a multiple of {self.k_multiple}")
        if n % self.n_multiple:
            out.append(f"N={n} is not a multiple of {self.n_multiple}")
        return out


NO_GATE = ShapeGate()
# CUDA _int_mm: M > 16 (pad to 32 rows, sliced back), K % 8 == 0, N % 8 == 0.
CUDA_INT_MM_GATE = ShapeGate(min_m=17, k_multiple=8, n_multiple=8, pad_m_to=32)
INT_MM_SHAPE_GATES: Mapping[str, ShapeGate] = {"cuda": CUDA_INT_MM_GATE}


class Probe:
    """Facts about the running torch and machine. Subclasses answer; nothing here runs a kernel."""

    name = "probe"
    torch_version: tuple[int, int] = (0, 0)
    cuda_version: str | None = None  # informational only: NEVER used to decide anything

    def cuda_available(self) -> bool:
        raise NotImplementedError

    def npu_module(self) -> ModuleType | None:
        """The ``torch_npu`` module, or None (see ``npu_missing_reason``)."""
        raise NotImplementedError

    def npu_missing_reason(self) -> str:
        return "torch_npu is not importable"

    def npu_available(self) -> bool:
        raise NotImplementedError

    def xpu_available(self) -> bool:
        raise NotImplementedError

    def mps_available(self) -> bool:
        raise NotImplementedError

    def has_kernel(self, op: str, dispatch_key: str) -> bool:
        raise NotImplementedError

    def shape_gate(self, kind: str) -> ShapeGate:
        return INT_MM_SHAPE_GATES.get(kind, NO_GATE)

    def cuda_capability(self, index: int | None) -> tuple[int, int] | None:
        """SM version of a CUDA device; None when CUDA is not available."""
        raise NotImplementedError

    def kitchen_module(self) -> tuple[ModuleType | None, str]:
        """``(comfy_kitchen, "")`` or ``(None, why)``; only asked for CUDA devices."""
        raise NotImplementedError

    def device_count(self, kind: str) -> int | None:
        """How many devices of ``kind`` this machine has (None: not known to this probe)."""
        return None

    def device_available(self, kind: str) -> bool:
        if kind == "cpu":
            return True
        return {
            "cuda": self.cuda_available,
            "npu": self.npu_available,
            "xpu": self.xpu_available,
            "mps": self.mps_available,
        }[kind]()


def dispatcher_has_kernel(op: str, dispatch_key: str) -> bool:
    """``torch._C._dispatch_has_kernel_for_dispatch_key``; False for unknown ops or keys."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key))
    except (RuntimeError, AttributeError):
        return False


class LiveProbe(Probe):
    """Asks the torch of this process. ``torch_npu`` and ``comfy_kitchen`` are imported on demand
    (every time: a failed import is not cached, a successful one is a ``sys.modules`` lookup)."""

    name = "live"

    def __init__(self) -> None:
        self.torch_version = parse_torch_version(torch.__version__)
        self.cuda_version = getattr(torch.version, "cuda", None)
        self._npu_error = ""

    def cuda_available(self) -> bool:
        return bool(torch.cuda.is_available())

    def device_count(self, kind: str) -> int | None:
        if kind == "cuda":
            return int(torch.cuda.device_count()) if self.cuda_available() else 0
        mod = getattr(torch, kind, None) if kind in ("npu", "xpu") else None
        try:
            return int(mod.device_count()) if mod is not None else None
        except Exception:  # a device module without a usable count: unknown
            return None

    def npu_module(self) -> ModuleType | None:
        self._npu_error = ""
        try:
            return importlib.import_module("torch_npu")
        except Exception as exc:  # ImportError, or a broken CANN install
            self._npu_error = f"torch_npu is not importable ({type(exc).__name__}: {exc})"
            return None

    def npu_missing_reason(self) -> str:
        return self._npu_error if self.npu_module() is None else ""

    def npu_available(self) -> bool:
        mod = self.npu_module()
        if mod is None:
            return False
        dev_mod = getattr(torch, "npu", None) or getattr(mod, "npu", None)
        try:
            return bool(dev_mod is not None and dev_mod.is_available())
        except Exception:
            return False

    def xpu_available(self) -> bool:
        xpu = getattr(torch, "xpu", None)
        try:
            return bool(xpu is not None and xpu.is_available())
        except Exception:
            return False

    def mps_available(self) -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available())

    def has_kernel(self, op: str, dispatch_key: str) -> bool:
        return dispatcher_has_kernel(op, dispatch_key)

    def cuda_capability(self, index: int | None) -> tuple[int, int] | None:
        if not torch.cuda.is_available():  # the only gate before any other torch.cuda call
            return None
        major, minor = torch.cuda.get_device_capability(index or 0)
        return major, minor

    def kitchen_module(self) -> tuple[ModuleType | None, str]:
        try:
            return importlib.import_module("comfy_kitchen"), ""
        except Exception as exc:
            return None, f"comfy_kitchen is not importable ({type(exc).__name__}: {exc})"


_LIVE: LiveProbe | None = None


def live_probe() -> LiveProbe:
    """The process-wide live probe (created on first use)."""
    global _LIVE
    if _LIVE is None:
        _LIVE = LiveProbe()
    return _LIVE


@dataclass
class StaticProbe(Probe):
    """Fixed answers, for tests and simulations. ``kernels=None`` asks the real dispatcher."""

    name: str = "static"
    torch_version: tuple[int, int] = (2, 13)
    cuda_version: str | None = None
    cuda: bool = False
    npu: ModuleType | None = None
    npu_device: bool = False
    xpu: bool = False
    mps: bool = False
    kernels: frozenset[tuple[str, str]] | None = None
    shape_gates: Mapping[str, ShapeGate] = field(default_factory=dict)
    kitchen: ModuleType | None = None
    cuda_cc: tuple[int, int] | None = None
    counts: Mapping[str, int] = field(default_factory=dict)  # devices per kind (absent: unknown)

    def cuda_available(self) -> bool:
        return self.cuda

    def device_count(self, kind: str) -> int | None:
        return self.counts.get(kind)

    def npu_module(self) -> ModuleType | None:
        return self.npu

    def npu_available(self) -> bool:
        return self.npu is not None and self.npu_device

    def xpu_available(self) -> bool:
        return self.xpu

    def mps_available(self) -> bool:
        return self.mps

    def has_kernel(self, op: str, dispatch_key: str) -> bool:
        if self.kernels is None:
            return dispatcher_has_kernel(op, dispatch_key)
        return (op, dispatch_key) in self.kernels

    def shape_gate(self, kind: str) -> ShapeGate:
        if kind in self.shape_gates:
            return self.shape_gates[kind]
        return super().shape_gate(kind)

    def cuda_capability(self, index: int | None) -> tuple[int, int] | None:
        return self.cuda_cc if self.cuda else None

    def kitchen_module(self) -> tuple[ModuleType | None, str]:
        if self.kitchen is None:
            return None, f"comfy_kitchen is not available to the {self.name} probe"
        return self.kitchen, ""
