"""SIMULATION of ``torch_npu`` (Ascend) on a CPU-only machine, for tests.

``SimulatedTorchNpu`` is a module object named ``torch_npu`` with the documented signatures of
``npu_dynamic_quant``, ``npu_rotate_quant`` and ``npu_quant_matmul`` (int8 path), their dtypes, shape rules and
semantics, computed exactly on the CPU data of simulated-NPU tensors (``simdevice.SimTensor``).
It refuses tensors that are not on the simulated NPU. ``simulated_npu()`` installs it as
``sys.modules["torch_npu"]`` (with ``torch.npu`` reporting one NPU) and sets ``torch.version.cuda`` (as NPU builds do)
while CUDA stays unavailable; everything is restored on exit. The runtime's ``npu`` backend then
imports and calls it exactly as it would the real module.

Simulated, documented behaviour: ``npu_dynamic_quant(x)``: x fp16/bf16 with >= 2 dims;
``scale = rowmax|x| / 127`` (fp32, shape ``x.shape[:-1]``, 0 for an all-zero row);
``y = clamp(round_half_even(x / scale), -128, 127)`` int8. ``npu_quant_matmul(x1, x2, scale, *,
offset, pertoken_scale, bias, output_dtype)``: int8 ``x1 [M, K]``, ``x2 [K, N]``; ``scale`` fp32/bf16
of 1 or N values; ``pertoken_scale`` fp32 ``[M]`` (then output fp16/bf16); ``out = acc * scale *
pertoken_scale (+ float bias)``, or ``(acc + int32 bias) * ...``, cast to ``output_dtype``.
``output_dtype=torch.int32`` (int8 x int8 only): the raw accumulator ``acc (+ int32 bias)``,
no ``pertoken_scale`` and no ``offset`` allowed, ``scale`` still required (1-D float32 of 1 or N
values) and NOT applied -- the rule as simulated here; callers pass ones so that the result
is the exact int32 sum either way.
``npu_format_cast(t, acl_format)``: ND (2) <-> FRACTAL_NZ (29) of a 2-D tensor on the NPU; for
int8 NZ the last two dims must be multiples of 16 and 32 (h3quant's contract: an unaligned weight
stays ND, so the simulation refuses instead of padding as the real op does); a non-contiguous
input is first made contiguous (logged as a copy, as the real op does internally); the result is
a new tensor tagged ``npu_format = 29`` (logged as a ``format_cast`` of its bytes) holding the
same values: the real op reorders them into 16 x 32 fractal tiles, which only the device sees.
``get_npu_format(t)`` returns that tag (2 = ND). ``npu_quant_matmul`` takes ``x2`` in either
format, as the real op does.
``npu_rotate_quant(x, h, *, dst_dtype=1, axis=-1, round_mode="rint", scale_alg=0,
dst_type_max=0.0, transpose_y=False)``: the block rotation fused with per-token int8
quantization: x fp16/bf16 ``[M, K]``, ``h`` ``[g, g]`` of x's dtype with ``16 <= g <= 1024``,
``K % 8 == 0`` and ``K % g == 0``; each group of g columns is multiplied by ``h`` with fp32
accumulation and quantized from fp32 (the rotated activation is not rounded to x's dtype first:
an assumption of the simulation, the fused kernel keeps it on chip), ``scale = rowmax / 127``
fp32 ``[M]`` (0 for an all-zero row), ``y = clamp(rint(r / scale), -128, 127)`` int8. Only the
int8 destination (``dst_dtype`` 1), ``axis=-1``, ``round_mode="rint"``, ``scale_alg=0``,
``dst_type_max=0`` and ``transpose_y=False`` are simulated.
Not simulated (raise NotImplementedError): batched (> 2-D) operands, int4/int32 packing, int64
scales from ``npu_trans_quant_param``, ``group_index``, formats other than ND / FRACTAL_NZ;
hardware rounding details of the real kernels (e.g. reciprocal multiply) and the per-chip limits.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Iterator, cast

import torch

from h3quant.runtime.capabilities import INT_MM_OP, StaticProbe
from h3quant.runtime.tp.group import Collectives
from h3quant.testing.simdevice import SimulatedDevice, SimTensor, Simulation, live_torch_version

_HALF = (torch.float16, torch.bfloat16)
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
# FRACTAL_NZ tile (rows, cols) of the last two dims, per dtype (int8 tiles are 16 x 32).
_NZ_TILE = {torch.int8: (16, 32), torch.float16: (16, 16), torch.bfloat16: (16, 16)}
# npu_rotate_quant: the documented rotation sizes and input-width multiple; int8 destination code
ROTATE_QUANT_MIN_SIZE, ROTATE_QUANT_MAX_SIZE = 16, 1024
ROTATE_QUANT_K_MULTIPLE = 8
ROTATE_QUANT_INT8 = 1


class SimulatedTorchNpu(types.ModuleType):
    """SIMULATED ``torch_npu``: only the int8 quantization ops h3quant uses. ``calls`` logs them."""

    __simulation__ = True

    def __init__(self, sim: SimulatedDevice, *, rotate_quant: bool = True) -> None:
        super().__init__("torch_npu")
        if rotate_quant:  # rotate_quant=False: an older torch_npu without the fused op
            self.npu_rotate_quant = self._npu_rotate_quant
        self._sim = sim
        # the simulation's device module (see simdevice.ensure_npu_device_type), registered at run
        # time, so unknown to torch's stubs
        self.npu = torch.npu  # type: ignore[attr-defined]
        self.calls: list[str] = []

    def _on_npu(self, op: str, **tensors) -> None:
        for arg, t in tensors.items():
            if t is None:
                continue
            if not isinstance(t, SimTensor) or t.device.type != "npu":
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise RuntimeError(f"{op}: {arg} must be a tensor on npu, got one on {where}")

    def npu_dynamic_quant(self, x, *, smooth_scales=None, group_index=None, dst_type=None):
        """Per-token symmetric int8 quantization: ``(y int8 like x, scale fp32 x.shape[:-1])``."""
        op = "npu_dynamic_quant"
        self._on_npu(op, x=x, smooth_scales=smooth_scales)
        if group_index is not None:
            raise NotImplementedError(f"{op}: group_index (MoE) is not simulated")
        if dst_type not in (None, torch.int8):
            raise NotImplementedError(f"{op}: dst_type {dst_type} is not simulated (int8 only)")
        if x.dtype not in _HALF:
            raise RuntimeError(f"{op}: x must be float16 or bfloat16, got {x.dtype}")
        if x.dim() < 2:
            raise RuntimeError(f"{op}: x must have more than 1 dim, got {x.dim()}")
        if smooth_scales is not None and (smooth_scales.dtype != x.dtype
                                          or tuple(smooth_scales.shape) != (x.shape[-1],)):
            raise RuntimeError(f"{op}: smooth_scales must be [{x.shape[-1]}] {x.dtype}")
        self.calls.append(op)
        with self._sim.kernel(f"torch_npu.{op}"):
            xf = x.inner.to(torch.float32)
            if smooth_scales is not None:
                xf = xf * smooth_scales.inner.to(torch.float32)
            scale = xf.abs().amax(dim=-1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            y = torch.round(xf / safe.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
        return SimTensor(y, x.device), SimTensor(scale, x.device)

    def _npu_rotate_quant(self, x, h, *, dst_dtype=1, axis=-1, round_mode="rint", scale_alg=0,
                         dst_type_max=0.0, transpose_y=False):
        """Rotation by ``h`` per group of columns, fused with per-token int8 quantization:
        ``(y int8 [M, K], scale fp32 [M])`` (see the module docstring)."""
        op = "npu_rotate_quant"
        self._on_npu(op, x=x, h=h)
        if dst_dtype != ROTATE_QUANT_INT8:
            raise NotImplementedError(f"{op}: dst_dtype {dst_dtype} is not simulated (int8 = 1)")
        if axis != -1 or round_mode != "rint" or scale_alg != 0 or dst_type_max != 0.0 \
                or transpose_y:
            raise NotImplementedError(f"{op}: only axis=-1, round_mode='rint', scale_alg=0, "
                                      "dst_type_max=0 and transpose_y=False are simulated")
        if x.dtype not in _HALF:
            raise RuntimeError(f"{op}: x must be float16 or bfloat16, got {x.dtype}")
        if h.dtype != x.dtype:
            raise RuntimeError(f"{op}: the rotation must have x's dtype {x.dtype}, got {h.dtype}")
        if x.dim() != 2:
            raise RuntimeError(f"{op}: x must be 2-D [M, K], got {x.dim()} dims")
        if x.numel() == 0:
            raise RuntimeError(f"{op}: empty tensors are not supported")
        if h.dim() != 2 or h.shape[0] != h.shape[1]:
            raise RuntimeError(f"{op}: the rotation must be square [g, g], got {list(h.shape)}")
        g, k = int(h.shape[0]), int(x.shape[1])
        if not ROTATE_QUANT_MIN_SIZE <= g <= ROTATE_QUANT_MAX_SIZE:
            raise RuntimeError(f"{op}: rotation size {g} is outside "
                               f"{ROTATE_QUANT_MIN_SIZE}..{ROTATE_QUANT_MAX_SIZE}")
        if k % ROTATE_QUANT_K_MULTIPLE:
            raise RuntimeError(f"{op}: input width {k} is not a multiple of "
                               f"{ROTATE_QUANT_K_MULTIPLE}")
        if k % g:
            raise RuntimeError(f"{op}: rotation size {g} does not divide the input width {k}")
        self.calls.append(op)
        with self._sim.kernel(f"torch_npu.{op}"):
            m = x.shape[0]
            r = (x.inner.to(torch.float32).reshape(m, k // g, g)
                 @ h.inner.to(torch.float32)).reshape(m, k)
            scale = r.abs().amax(dim=-1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            y = torch.round(r / safe.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
        return SimTensor(y, x.device), SimTensor(scale, x.device)

    def get_npu_format(self, t) -> int:
        """The storage format of a tensor on the NPU (2 = ND, 29 = FRACTAL_NZ)."""
        self._on_npu("get_npu_format", t=t)
        return getattr(t, "npu_format", ACL_FORMAT_ND)

    def npu_format_cast(self, t, acl_format: int):
        """A copy of ``t`` in storage format ``acl_format`` (ND or FRACTAL_NZ); see the module
        docstring for the simulated alignment rules."""
        op = "npu_format_cast"
        self._on_npu(op, t=t)
        if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
            raise NotImplementedError(f"{op}: format {acl_format} is not simulated (2 ND, 29 NZ)")
        if acl_format == getattr(t, "npu_format", ACL_FORMAT_ND):
            return t
        if acl_format == ACL_FORMAT_FRACTAL_NZ:
            if t.dim() != 2:
                raise NotImplementedError(f"{op}: only 2-D tensors are simulated for FRACTAL_NZ")
            tile = _NZ_TILE.get(t.dtype)
            if tile is None:
                raise RuntimeError(f"{op}: FRACTAL_NZ of {t.dtype} is not supported")
            if t.shape[0] % tile[0] or t.shape[1] % tile[1]:
                raise RuntimeError(f"{op}: {t.dtype} [{t.shape[0]}, {t.shape[1]}] is not aligned "
                                   f"to the FRACTAL_NZ tile {tile[0]} x {tile[1]}")
        self.calls.append(op)
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous():
            self._sim._log("copy", f"torch_npu.{op}:contiguous", True, nbytes)
        with self._sim.kernel(f"torch_npu.{op}"):
            out = SimTensor(t.inner.contiguous().clone(), t.device)  # a new device buffer
        self._sim._log("format_cast", f"torch_npu.{op}", True, nbytes)
        out.npu_format = acl_format
        return out

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                         output_dtype=None):
        """Quantized matmul ``x1 @ x2`` with the dequantization scales applied inside the op."""
        op = "npu_quant_matmul"
        self._on_npu(op, x1=x1, x2=x2, scale=scale, offset=offset,
                     pertoken_scale=pertoken_scale, bias=bias)
        if x1.dtype != torch.int8 or x2.dtype != torch.int8:
            raise NotImplementedError(f"{op}: only int8 x int8 is simulated, got {x1.dtype}, {x2.dtype}")
        if x1.dim() != 2 or x2.dim() != 2:
            raise NotImplementedError(f"{op}: only 2-D operands are simulated")
        if x1.numel() == 0 or x2.numel() == 0:
            raise RuntimeError(f"{op}: empty tensors are not supported")
        (m, k), (k2, n) = x1.shape, x2.shape
        if k != k2:
            raise RuntimeError(f"{op}: x1 [{m}, {k}] and x2 [{k2}, {n}] disagree on K")
        out_dtype = torch.int8 if output_dtype is None else output_dtype
        if out_dtype not in (torch.int8, torch.float16, torch.bfloat16, torch.int32):
            raise RuntimeError(f"{op}: output_dtype must be int8, float16, bfloat16 or int32, "
                               f"got {out_dtype}")
        if out_dtype == torch.int32 and (pertoken_scale is not None or offset is not None):
            raise RuntimeError(f"{op}: int32 output takes no pertoken_scale and no offset")
        if scale.dtype == torch.int64:
            raise NotImplementedError(f"{op}: int64 scales (npu_trans_quant_param) are not simulated")
        if scale.dtype not in (torch.float32, torch.bfloat16) or scale.dim() != 1 \
                or scale.numel() not in (1, n):
            raise RuntimeError(f"{op}: scale must be 1-D float32/bfloat16 of 1 or {n} values")
        if pertoken_scale is not None:
            if pertoken_scale.dtype != torch.float32 or tuple(pertoken_scale.shape) != (m,):
                raise RuntimeError(f"{op}: pertoken_scale must be float32 [{m}]")
            if out_dtype not in _HALF:
                raise RuntimeError(f"{op}: pertoken_scale needs output_dtype float16 or bfloat16")
        if offset is not None and (out_dtype != torch.int8 or offset.dtype != torch.float32
                                   or offset.dim() != 1 or offset.numel() not in (1, n)):
            raise RuntimeError(f"{op}: offset must be float32 [1 or {n}] with int8 output")
        if bias is not None:
            allowed = {torch.int32}
            if out_dtype == torch.bfloat16:
                allowed |= {torch.bfloat16, torch.float32}
            elif out_dtype == torch.float16 and pertoken_scale is not None:
                allowed |= {torch.float16, torch.float32}
            if bias.dtype not in allowed or tuple(bias.shape) != (n,):
                raise RuntimeError(f"{op}: bias must be [{n}] of {sorted(map(str, allowed))}, "
                                   f"got {bias.dtype} {list(bias.shape)}")
        self.calls.append(op)
        with self._sim.kernel(f"torch_npu.{op}"):
            acc = x1.inner.to(torch.float64) @ x2.inner.to(torch.float64)  # exact int32 sums
            if bias is not None and bias.dtype == torch.int32:
                acc = acc + bias.inner.to(torch.float64)
            if out_dtype == torch.int32:
                if acc.abs().max().item() >= 2**31:  # hardware would wrap: refuse loudly
                    raise RuntimeError(f"{op}: int32 accumulator overflow")
                return SimTensor(acc.to(torch.int32), x1.device)
            y = acc.to(torch.float32) * scale.inner.to(torch.float32).reshape(1, -1)
            if pertoken_scale is not None:
                y = y * pertoken_scale.inner.reshape(-1, 1)
            if bias is not None and bias.dtype != torch.int32:
                y = y + bias.inner.to(torch.float32)
            if out_dtype == torch.int8:
                if offset is not None:
                    y = y + offset.inner.reshape(1, -1)
                y = torch.round(y).clamp_(-128, 127)
            y = y.to(out_dtype)
        return SimTensor(y, x1.device)


def npu_probe(module: SimulatedTorchNpu, cuda_version: str | None = "12.1") -> StaticProbe:
    """SIMULATED Ascend machine: torch_npu present and available, CUDA version set, no CUDA."""
    return StaticProbe(name="simulated-npu", torch_version=live_torch_version(),
                       cuda_version=cuda_version, cuda=False, npu=module, npu_device=True)


@contextmanager
def simulated_npu(cuda_version: str | None = "12.1", *,
                  rotate_quant: bool = True) -> Iterator[Simulation]:
    """SIMULATION of an Ascend NPU machine (see module docstring). ``extras["module"]`` is the
    simulated torch_npu; ``aten::_int_mm`` on NPU tensors runs but is logged ``cpu_fallback``.
    ``rotate_quant=False``: a torch_npu without ``npu_rotate_quant``."""
    dev = SimulatedDevice("npu", cpu_fallback_ops=(INT_MM_OP,))
    module = SimulatedTorchNpu(dev, rotate_quant=rotate_quant)
    missing = object()
    saved = (sys.modules.get("torch_npu", missing), torch.version.cuda, torch.cuda.is_available)
    sys.modules["torch_npu"] = module
    torch.version.cuda = cuda_version
    # An Ascend machine has no NVIDIA device, even where this process runs on one.
    torch.cuda.is_available = lambda: False
    try:
        with dev:
            yield Simulation(dev, npu_probe(module, cuda_version), {"module": module})
    finally:
        old_mod, old_cuda, old_available = saved
        torch.cuda.is_available = old_available
        if old_mod is missing:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = cast(types.ModuleType, old_mod)
        torch.version.cuda = old_cuda


class SimNpuCollectives(Collectives):
    """SIMULATED hccl transport for tensor-parallel tests: the collectives of
    ``h3quant.runtime.tp.group`` on simulated-NPU tensors, carried by the CPU process group
    (gloo) on their CPU data and handed back as simulated-NPU tensors. On Ascend, hccl moves
    device memory directly; nothing here is a device-to-host copy of the runtime. Like hccl (and
    nccl), it carries only tensors on the device: a host tensor is refused."""

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, SimTensor):
            raise RuntimeError(f"hccl (simulated) carries tensors on the NPU only, got one on "
                               f"{t.device}")
        return t.inner.contiguous()

    def _unwire(self, wire: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return SimTensor(wire, like.device) if isinstance(like, SimTensor) else wire
