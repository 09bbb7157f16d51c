"""Backend registry and the one dispatch decision per layer.

Every backend answers, per device, whether it can run and why not; per layer, whether it admits
the layer's shapes. ``select_backend`` walks the device's preference order once, at load; a
requested backend that cannot run on the device raises ``DeviceError`` listing every backend's
reason. A layer refused by its int8 kernel (CUDA K/N gate, NPU admission) or flagged
``full_precision_matrix_mult`` runs ``dequant`` on the same device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h3quant.errors import DeviceError, TpError
from h3quant.runtime.backends.base import (
    Backend,
    BackendStatus,
    Int8Weights,
    LinearOptions,
    Runner,
)
from h3quant.runtime.backends.dequant import DequantBackend
from h3quant.runtime.backends.kitchen import KitchenBackend
from h3quant.runtime.backends.npu import NpuBackend
from h3quant.runtime.backends.reference import (
    ReferenceBackend,
    reference_linear,
    w8a8_emulation,
)
from h3quant.runtime.backends.torch_int8 import TorchInt8Backend
from h3quant.runtime.capabilities import Probe, live_probe
from h3quant.runtime.devices import Device, parse_device

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (ReferenceBackend(), TorchInt8Backend(), NpuBackend(), DequantBackend(), KitchenBackend())
}

# Automatic choice per device kind, best first. ``reference`` is only used when requested.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": ("kitchen", "torch-int8", "dequant"),
    "cpu": ("torch-int8", "dequant"),
    "xpu": ("torch-int8", "dequant"),
    "mps": ("torch-int8", "dequant"),
    "npu": ("npu", "dequant"),
}
DEQUANTIZED = ("dequant", "reference")


def int32_matmul_for(device: Device, probe: Probe | None = None):
    """The raw int8 x int8 -> int32 matmul of the first backend in ``device``'s preference
    order that has one (tensor parallel's shared activation scale); TpError when none can."""

    probe = probe or live_probe()
    for name in PREFERENCE.get(device.kind, ()):
        fn = BACKENDS[name].int32_matmul(device, probe)
        if fn is not None:
            return fn
    raise TpError(f"shared activation scale needs an int8 x int8 -> int32 matmul on {device}; "
                  "no backend offers one there; use --tp-scale per-rank")


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise DeviceError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None


def list_backends(device: str | Device = "auto", probe: Probe | None = None) -> list[BackendStatus]:
    """Every backend's availability on ``device`` with its reasons, for ``h3quant backends``."""
    probe = probe or live_probe()
    dev = parse_device(device, probe=probe)
    out = []
    for b in BACKENDS.values():
        cap = b.status(dev, probe)
        out.append(BackendStatus(b.name, cap.available, cap.reasons, b.summary))
    return out


def _describe(statuses: list[BackendStatus]) -> str:
    return "; ".join(f"{s.name}: {s.reason}" for s in statuses)


@dataclass(frozen=True)
class Selection:
    """The decision: ``backend`` runs; ``rejected`` maps each skipped backend to its reasons."""

    backend: Backend
    device: Device
    fallback_reason: str | None = None
    rejected: dict[str, tuple[str, ...]] = field(default_factory=dict)


def select_backend(
    w: Int8Weights,
    device: Device,
    probe: Probe,
    *,
    requested: str | None = None,
    full_precision: bool = False,
) -> Selection:
    """Choose the backend for one layer, once."""
    statuses = {s.name: s for s in list_backends(device, probe)}
    if requested is not None:
        chosen = get_backend(requested)
        if not statuses[chosen.name].available:
            raise DeviceError(
                f"backend {requested!r} cannot run on {device}: {statuses[chosen.name].reason}. "
                f"All backends on {device}: {_describe(list(statuses.values()))}"
            )
        order: tuple[str, ...] = (chosen.name,)
    else:
        order = PREFERENCE[device.kind]

    rejected: dict[str, tuple[str, ...]] = {}
    if full_precision:
        order = tuple(n for n in order if n in DEQUANTIZED) or ("dequant",)
    chosen_name = None
    for name in order:
        st = statuses[name]
        if not st.available:
            rejected[name] = st.reasons
            continue
        refused = BACKENDS[name].admit(w, device, probe)
        if refused:
            rejected[name] = tuple(refused)
            continue
        chosen_name = name
        break
    if chosen_name is None:
        if not statuses["dequant"].available:
            raise DeviceError(
                f"no backend can run this layer on {device}. "
                f"All backends on {device}: {_describe(list(statuses.values()))}"
            )
        chosen_name = "dequant"
    fallback = None
    if full_precision:
        fallback = "layer is full_precision_matrix_mult"
    elif chosen_name == "dequant" and order[0] != "dequant":
        fallback = "; ".join(f"{n}: " + "; ".join(r) for n, r in rejected.items())
    return Selection(BACKENDS[chosen_name], device, fallback, rejected)


def bind_backend(
    w: Int8Weights, selection: Selection, probe: Probe, options: LinearOptions
) -> Runner:
    return selection.backend.bind(w, selection.device, probe, options)


__all__ = [
    "BACKENDS",
    "PREFERENCE",
    "Backend",
    "BackendStatus",
    "Int8Weights",
    "LinearOptions",
    "Runner",
    "Selection",
    "bind_backend",
    "get_backend",
    "list_backends",
    "reference_linear",
    "select_backend",
    "w8a8_emulation",
]
