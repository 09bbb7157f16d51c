"""SIMULATION of accelerator devices on a CPU-only machine (tests only; never used by the runtime).

A ``SimTensor`` is a CPU tensor presented to torch as living on a simulated device (``npu:0`` or
``mps:0``): its ``.device`` reports that device, and every aten op on it runs on the wrapped CPU
data. Inside a ``SimulatedDevice`` context:

- factories and ``Tensor.to`` targeting the device create/copy SimTensors (logged ``to_device``);
- copies from the device to the CPU are logged (``to_cpu``), so tests can prove nothing left it;
- an op mixing SimTensors with non-scalar CPU tensors raises, as on real hardware;
- ``missing_ops`` raise ``NotImplementedError`` (MPS before torch 2.15 has no ``aten::_int_mm``);
- ``missing_dtypes`` cannot live on the device: moving or creating such a tensor there, or an op
  on the device producing one, raises ``TypeError`` (MPS has no float64, as the real one);
  ``cpu_fallback_ops`` run but are logged ``cpu_fallback`` (``aten::_int_mm`` under torch_npu);
- every aten op is logged with whether it touched the device.

Limits: one simulated device at a time, index 0; no streams, memory stats, formats or autograd
device semantics; numerics are the CPU's. ``npu`` needs torch's PrivateUse1 backend renamed to
"npu" and a ``torch.npu`` module registered (process-wide and irreversible, as with a real
torch_npu); that module reports the NPU available only while a simulation is active.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from h3quant.errors import DeviceError
from h3quant.runtime.capabilities import INT_MM_OP, StaticProbe, parse_torch_version

_ACTIVE: list["SimulatedDevice"] = []


class SimTensor(torch.Tensor):
    """A CPU tensor (``.inner``) tagged as living on a simulated device."""

    # The CPU data. It hides the method Tensor.inner (torch.inner), which nothing calls on a
    # SimTensor.
    inner: torch.Tensor  # type: ignore[assignment]
    npu_format: int  # set by the simulated torch_npu.npu_format_cast

    # torch's documented way to turn __torch_function__ off in a subclass; the stubs type the
    # attribute as a method with another signature.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device):
        r: SimTensor = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=device, requires_grad=False,
        )
        r.inner = inner
        return r

    def __repr__(self, *, tensor_contents=None):  # the signature of Tensor.__repr__
        return f"SimTensor(device={self.device}, {self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Outside a simulation: run on the CPU data, keep the tag, check and log nothing.
        device = next(t.device for t in tree_leaves((args, kwargs)) if isinstance(t, SimTensor))
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: SimTensor(t, device) if isinstance(t, torch.Tensor) else t, out)


def unwrap(t):
    """The CPU data of a SimTensor (anything else is returned as is). Logs nothing."""
    return t.inner if isinstance(t, SimTensor) else t


@dataclass(frozen=True)
class SimEvent:
    kind: str  # "op", "to_device", "to_cpu", "cpu_fallback", "kernel", "copy", "format_cast"
    name: str
    on_device: bool = False
    nbytes: int = 0  # bytes moved or copied (copy events: to_device, to_cpu, copy, format_cast)


# aten ops that copy tensor data on the device (logged as "copy" events besides "op").
COPY_OPS = frozenset({"aten::clone", "aten::_to_copy", "aten::copy_", "aten::contiguous"})
COPY_KINDS = ("to_device", "to_cpu", "copy", "format_cast")


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _as_device(d) -> torch.device | None:
    if d is None or isinstance(d, torch.device):
        return d
    if isinstance(d, (str, int)):
        return torch.device(d)
    return None


_HOST_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"})


class _FunctionBoundary(TorchFunctionMode):
    def __init__(self, sim: "SimulatedDevice") -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            return self.sim._tensor_to(func, args, kwargs)
        if self.sim.is_sim(kwargs.get("device")):
            out = func(*args, **{**kwargs, "device": "cpu"})
            self.sim._check_outputs(out, getattr(func, "__name__", str(func)))
            self.sim._log("to_device", getattr(func, "__name__", str(func)), True)
            return self.sim._wrap(out)
        if any(isinstance(t, SimTensor) for t in tree_leaves((args, kwargs))):
            try:
                return func(*args, **kwargs)
            except RuntimeError as exc:
                # A few bindings (indexing, copy_, contiguous, item, ...) take a device guard
                # before dispatch, which a simulated device lacks; nothing ran yet.
                if "is not linked with support for" not in str(exc):
                    raise
                return self.sim._unguarded(func, args, kwargs)
        return func(*args, **kwargs)


class _DispatchLog(TorchDispatchMode):
    def __init__(self, sim: "SimulatedDevice") -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.sim._dispatch(func, args, kwargs or {})


class SimulatedDevice:
    """Context manager running SimTensors of ``kind`` (``"npu"`` or ``"mps"``) on the CPU."""

    def __init__(self, kind: str, *, missing_ops=(), cpu_fallback_ops=(), missing_dtypes=()) -> None:
        if kind == "npu":
            ensure_npu_device_type()
        self.kind = kind
        self.device = torch.device(kind, 0)
        self.missing_ops = frozenset(missing_ops)
        self.cpu_fallback_ops = frozenset(cpu_fallback_ops)
        self.missing_dtypes = frozenset(missing_dtypes)
        self.events: list[SimEvent] = []
        self._quiet = 0
        self._forced = 0
        self._modes: list = []

    # -- test helpers -------------------------------------------------------------------------
    def put(self, t: torch.Tensor) -> SimTensor:
        """Place a CPU tensor on the simulated device (test setup; not logged)."""
        return SimTensor(t.detach().clone(), self.device)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """Read a SimTensor back as a CPU tensor (test inspection; not logged)."""
        if not isinstance(t, SimTensor):
            raise DeviceError(f"expected a tensor on simulated {self.kind}, got one on {t.device}")
        return t.inner.clone()

    def ops(self, *, on_device: bool | None = None) -> list[str]:
        return [e.name for e in self.events
                if e.kind == "op" and (on_device is None or e.on_device == on_device)]

    def saw(self, op: str) -> bool:
        return any(e.name == op for e in self.events)

    def of_kind(self, kind: str) -> list[SimEvent]:
        return [e for e in self.events if e.kind == kind]

    def copies(self, min_bytes: int = 0) -> list[SimEvent]:
        """Every logged data copy (host<->device moves, on-device copies, format casts) of at
        least ``min_bytes`` bytes, in order."""
        return [e for e in self.events if e.kind in COPY_KINDS and e.nbytes >= min_bytes]

    @contextmanager
    def kernel(self, name: str) -> Iterator[None]:
        """Log one simulated device kernel and run its CPU body unlogged."""
        self._log("kernel", name, True)
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def is_sim(self, d) -> bool:
        dev = _as_device(d)
        return dev is not None and dev.type == self.kind

    # -- context ------------------------------------------------------------------------------
    def __enter__(self) -> "SimulatedDevice":
        if _ACTIVE:
            raise DeviceError("only one simulated device may be active at a time")
        self._modes = [_FunctionBoundary(self), _DispatchLog(self)]
        for m in self._modes:
            m.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []

    # -- internals ----------------------------------------------------------------------------
    def _log(self, kind: str, name: str, on_device: bool, nbytes: int = 0) -> None:
        if not self._quiet:
            self.events.append(SimEvent(kind, name, on_device, nbytes))

    def _wrap(self, out):
        return tree_map(lambda t: SimTensor(t, self.device) if isinstance(t, torch.Tensor) else t, out)

    def _check_dtype(self, dtype: torch.dtype, what: str) -> None:
        if dtype in self.missing_dtypes:
            raise TypeError(f"{what}: the {self.kind.upper()} device has no {dtype} (simulated); "
                            "use float32 there")

    def _check_outputs(self, out, name: str) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._check_dtype(t.dtype, name)

    def _tensor_to(self, func, args, kwargs):
        src = args[0]
        target, dtype = _as_device(kwargs.get("device")), kwargs.get("dtype")
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                target, dtype = a.device, a.dtype
            elif isinstance(a, torch.dtype):
                dtype = a
            elif _as_device(a) is not None:
                target = _as_device(a)
        on_dev = isinstance(src, SimTensor)
        if (target is not None and target.type == self.kind) or (on_dev and target is None):
            self._check_dtype(dtype or src.dtype, "Tensor.to")
        if target is not None and target.type == self.kind and not on_dev:
            self._log("to_device", "Tensor.to", True, _nbytes(src))
            data = src.detach().to(dtype=dtype or src.dtype, copy=True)
            return SimTensor(data, self.device)
        if target is not None and target.type == "cpu" and on_dev:
            self._log("to_cpu", "Tensor.to", True, _nbytes(src))
            return src.inner.to(dtype=dtype or src.dtype, copy=True)
        if target is not None and target.type == self.kind and on_dev:
            return src if dtype in (None, src.dtype) else func(src, dtype)
        return func(*args, **kwargs)

    def _mixing_check(self, leaves, name: str) -> None:
        for t in leaves:
            if isinstance(t, torch.Tensor) and not isinstance(t, SimTensor) and t.dim() > 0:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, {self.device} and {t.device}! (simulated {self.kind}, in {name})"
                )

    def _unguarded(self, func, args, kwargs):
        """Run a guard-taking binding on the CPU data; the aten ops it issues count as on-device."""
        name = getattr(func, "__name__", str(func))
        if name == "copy_":
            dst, src = args[0], args[1]
            if isinstance(src, SimTensor) != isinstance(dst, SimTensor):
                self._log("to_cpu" if isinstance(src, SimTensor) else "to_device", "Tensor.copy_",
                          True, _nbytes(src))
        else:
            self._mixing_check(tree_leaves((args, kwargs)), f"Tensor.{name}")
        if name in _HOST_READS:
            self._log("to_cpu", f"Tensor.{name}", True)
        self._forced += 1
        try:
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        finally:
            self._forced -= 1
        if args and out is unwrap(args[0]):
            return args[0]
        return self._wrap(out)

    def _dispatch(self, func, args, kwargs):
        name = func._schema.name
        leaves = tree_leaves((args, kwargs))
        has_sim = any(isinstance(t, SimTensor) for t in leaves)
        on_dev = has_sim or self._forced > 0
        target = _as_device(kwargs.get("device"))
        to_dev = target is not None and target.type == self.kind
        if name == "aten::copy_" and has_sim and not all(isinstance(t, SimTensor) for t in args[:2]):
            dst, src = args[0], args[1]
            kind = "to_cpu" if isinstance(src, SimTensor) else "to_device"
            self._log(kind, name, True, _nbytes(src))
            unwrap(dst).copy_(unwrap(src))
            return dst
        self._log("op", name, on_dev or to_dev)
        if has_sim and name in COPY_OPS:
            self._log("copy", name, True, _nbytes(args[0]) if args else 0)
        if has_sim:
            self._mixing_check(leaves, name)
            if name == "aten::_local_scalar_dense":  # .item(), bool(t): a device-to-host read
                self._log("to_cpu", name, True)
        if on_dev:
            if name in self.missing_ops:
                raise NotImplementedError(
                    f"The operator '{name}' is not currently implemented for the "
                    f"{self.kind.upper()} device (simulated)"
                )
            if name in self.cpu_fallback_ops:
                self._log("cpu_fallback", name, True)
        if to_dev:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if name == "aten::_to_copy" and has_sim and target is not None and target.type == "cpu":
            self._log("to_cpu", name, True, _nbytes(args[0]))
            return out
        if on_dev or to_dev:
            self._check_outputs(out, name)
        return self._wrap(out) if (has_sim or to_dev) else out


class _SimNpuRuntime(types.ModuleType):
    """The ``torch.npu`` device module registered for the simulation: available only while a
    simulated NPU is active, so ``torch.accelerator`` keeps working (and says "no NPU") outside."""

    def __init__(self) -> None:
        super().__init__("torch.npu")

    def is_available(self) -> bool:
        return any(s.kind == "npu" for s in _ACTIVE)

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def current_device(self) -> int:
        return 0

    def is_initialized(self) -> bool:
        return True

    def _lazy_init(self) -> None:
        return None

    def _is_in_bad_fork(self) -> bool:  # torch.manual_seed asks before seeding the device
        return False

    def manual_seed_all(self, seed: int) -> None:
        """Nothing to seed: simulated NPU tensors draw from the CPU generator, which
        ``torch.manual_seed`` has already seeded."""
        return None


def ensure_npu_device_type() -> None:
    """Make ``torch.device("npu")`` valid: rename the PrivateUse1 backend to "npu" and register a
    ``torch.npu`` module (process-wide and irreversible, as importing a real torch_npu is)."""
    name = torch._C._get_privateuse1_backend_name()
    if name != "npu":
        if name != "privateuseone":
            raise DeviceError(f"cannot simulate npu: PrivateUse1 is already named {name!r}")
        torch.utils.rename_privateuse1_backend("npu")
    if getattr(torch, "npu", None) is None:
        torch._register_device_module("npu", _SimNpuRuntime())


@dataclass
class Simulation:
    """A running simulation: the device context, the probe describing the simulated machine."""

    device: SimulatedDevice
    probe: StaticProbe
    extras: dict = field(default_factory=dict)


def mps_probe(torch_version: tuple[int, int] = (2, 13)) -> StaticProbe:
    """SIMULATED Apple-silicon profile: MPS present; ``_int_mm`` MPS kernel only from torch 2.15."""
    kernels = {(INT_MM_OP, "CPU")}
    if torch_version >= (2, 15):
        kernels.add((INT_MM_OP, "MPS"))
    return StaticProbe(name="simulated-mps", torch_version=torch_version, mps=True,
                       kernels=frozenset(kernels))


@contextmanager
def simulated_mps(torch_version: tuple[int, int] = (2, 13)) -> Iterator[Simulation]:
    """SIMULATION of an MPS device: no float64 tensors on it (as real MPS); before torch 2.15 any
    ``aten::_int_mm`` on it raises."""
    missing = () if torch_version >= (2, 15) else (INT_MM_OP,)
    with SimulatedDevice("mps", missing_ops=missing, missing_dtypes=(torch.float64,)) as dev:
        yield Simulation(dev, mps_probe(torch_version))


def live_torch_version() -> tuple[int, int]:
    return parse_torch_version(torch.__version__)
