"""Sharded linears: column-parallel (the runtime's own layer on the rank's rows) and
row-parallel with a shared or per-rank activation scale (FORMATS.md 7).

Row-parallel, ``shared`` (default), per call on the rank's K slice ``x_r``:

    xr   = rotate(x_r)                      # per rotation group; slices hold whole groups
    amax = all_reduce_MAX(rowmax |xr|)      # the single-device per-token abs-max
    s_x  = max(amax / 127, 1e-30)
    q_x  = clamp(round_half_even(xr / s_x), -128, 127)       # the single-device codes
    acc  = all_reduce_SUM(q_x @ q_w_r^T)    # int32 partials, int32 sum: exact
    y    = (acc * s_x * s_w) + bias         # scaled once, bias once

which is, operation for operation, what the single-device ``torch-int8`` runner computes
(``quantize_activation``, ``_int_mm``, ``scale_accumulator``, ``add_bias``), so the result is
bit-identical to one device. The int32 matmul is ``torch._int_mm`` (CPU, CUDA within its shape
gate) or ``npu_quant_matmul(..., output_dtype=int32)`` on Ascend.

Row-parallel, ``per-rank`` (what vLLM-Ascend / MindIE-style stacks do): each rank runs the
runtime's own layer on its K slice (its own per-token scale, its device's usual backend), the
float partial outputs are summed in fp32 (all_reduce SUM), the bias is added once. Close to one
device, not equal to it (measured by ``verify --tp``).

A rank whose regrouped K slice is empty (more ranks than rotation groups) contributes zeros.
Float (unquantized) row-parallel layers sum fp32 partials in either mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from h3quant.errors import DeviceError
from h3quant.runtime.int8_math import (
    add_bias,
    apply_input_act,
    check_input_act,
    rotate_activation,
    scale_accumulator,
)
from h3quant.runtime.loader import LoadedLayer
from h3quant.runtime.tp.group import Collectives
from h3quant.runtime.tp.plan import (
    MAX_INT32_K,
    SCALE_MODES,
    ColumnShard,
    RowShard,
    TpError,
)

SCALE_MIN = 1e-30  # the int8 codec's floor for activation scales


def quantize_shared(xr: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of fp32 ``xr [M, K_r]`` with the shared per-row abs-max ``amax [M]``: the int8
    codec's per-row activation quantizer, with the row abs-max supplied instead of computed."""
    s_x = (amax.to(torch.float32) / 127.0).clamp_(min=SCALE_MIN)
    q = (xr / s_x.reshape(-1, 1)).round_().clamp_(-128.0, 127.0).to(torch.int8)
    return q, s_x


def int32_matmul_fn(device, probe):
    """A callable ``(q_x [M, K] int8, w_t [K, N] int8) -> int32 [M, N]`` on ``device``, or
    TpError saying why the shared-scale mode cannot run there: the backend registry's choice
    (``h3quant.runtime.backends.int32_matmul_for``), never a test of the device's kind."""
    from h3quant.runtime.backends import int32_matmul_for

    return int32_matmul_for(device, probe)


def row_scale(layer: LoadedLayer) -> torch.Tensor:
    """The fp32 per-row weight scale [N] (or [1]) the int8 grid is multiplied by."""
    t = layer.tensors
    s = t["weight_scale"] if "weight_scale" in t else t["weight_s_channel"]
    return s.to(torch.float32).reshape(-1)


class RowParallelLinear(nn.Module):
    """The rank's K slice of a row-parallel layer (see the module docstring)."""

    backend_name = "tp-row"

    def __init__(self, layer: LoadedLayer, shard: RowShard, full_k: int, comm: Collectives, *,
                 mode: str, device, probe, make_local) -> None:
        super().__init__()
        if mode not in SCALE_MODES:
            raise TpError(f"unknown scale mode {mode!r} (expected one of {', '.join(SCALE_MODES)})")
        self.name, self.shard, self.full_k, self.comm, self.mode = layer.name, shard, full_k, comm, mode
        self.device = device
        tdev = device.torch_device
        self.quantized = layer.is_quantized
        self.out_features = layer.out_features
        self.bias = None if layer.bias is None else layer.bias.to(tdev)
        self.in_width = full_k // comm.world  # the natural slice the layer input arrives as
        self.local: nn.Module | None = None  # the per-rank mode's local linear
        if self.quantized and mode == "shared":
            self.scale = row_scale(layer).to(tdev)
            self.convrot = layer.convrot
            self.group_size = layer.convrot_groupsize
        if shard.width == 0:
            self.backend_name = "tp-row(empty)"
        elif not self.quantized:
            self.weight = layer.weight.to(tdev)
            self.backend_name = "tp-row(float)"
        elif mode == "per-rank":
            no_bias = LoadedLayer(layer.name, {k: v for k, v in layer.tensors.items()
                                               if k != "bias"}, layer.fields, layer.source)
            self.local = make_local(no_bias)
            self.backend_name = f"tp-row(per-rank, {self.local.backend_name})"
        else:
            if full_k > MAX_INT32_K:
                raise TpError(f"K={full_k} > {MAX_INT32_K}: int32 sums could overflow",
                              tensor=layer.name)
            self.w_t = layer.int8_grid()[0].to(tdev).t()
            self.matmul = int32_matmul_fn(device, probe)
            self.backend_name = "tp-row(shared, int32)"

    def _input(self, x: torch.Tensor, input_act) -> torch.Tensor:
        x = apply_input_act(x, input_act)
        if x.shape[-1] != self.in_width:
            raise DeviceError(f"{self.name}: rank input width {x.shape[-1]} != K/tp = "
                              f"{self.in_width}")
        if self.shard.gather:
            parts = self.comm.all_gather(x.contiguous(), f"{self.name} input (regroup)")
            x = torch.cat(parts, dim=-1)
            return x[..., self.shard.k0:self.shard.k1]
        return x

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        check_input_act(input_act)
        lead = x.shape[:-1]
        dtype = x.dtype
        m = 1
        for d in lead:
            m *= int(d)
        xk = self._input(x, input_act).reshape(m, self.shard.width)
        if self.quantized and self.mode == "shared":
            y = self._shared(xk, m, dtype)
        else:
            part = self._partial(xk, m)
            y = self.comm.all_reduce(part, "sum", f"{self.name} fp32 partial outputs").to(dtype)
        return add_bias(y, self.bias).reshape(*lead, self.out_features)

    def _shared(self, xk: torch.Tensor, m: int, dtype) -> torch.Tensor:
        dev = xk.device
        if self.shard.width:
            xr = rotate_activation(xk, self.convrot, self.group_size)
            amax = xr.abs().amax(dim=1)
        else:
            amax = torch.zeros(m, dtype=torch.float32, device=dev)
        amax = self.comm.all_reduce(amax, "max", f"{self.name} activation abs-max")
        if self.shard.width:
            q_x, s_x = quantize_shared(xr, amax)
            acc = self.matmul(q_x, self.w_t)
        else:
            s_x = (amax / 127.0).clamp_(min=SCALE_MIN)
            acc = torch.zeros((m, self.out_features), dtype=torch.int32, device=dev)
        acc = self.comm.all_reduce(acc, "sum", f"{self.name} int32 partial sums")
        return scale_accumulator(acc, s_x, self.scale, dtype)

    def _partial(self, xk: torch.Tensor, m: int) -> torch.Tensor:
        dev = xk.device
        if not self.shard.width:
            return torch.zeros((m, self.out_features), dtype=torch.float32, device=dev)
        if not self.quantized:
            return F.linear(xk.float(), self.weight.float())
        assert self.local is not None  # a quantized layer here runs in the per-rank mode
        return self.local(xk).float()


def column_linear(layer: LoadedLayer, shard: ColumnShard, make_local):
    """A column-parallel shard is the runtime's own layer on the rank's rows (exact)."""
    return make_local(layer)
