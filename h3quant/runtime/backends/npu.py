"""``npu``: Ascend, through ``torch_npu.npu_dynamic_quant`` + ``torch_npu.npu_quant_matmul``.

A ConvRot layer uses ``torch_npu.npu_rotate_quant`` (the block rotation fused with the per-token
int8 quantization; ``H_g`` in the activation dtype) when the installed torch_npu has it and the
call fits its documented limits (rotation size 16..1024, input width a multiple of 8, fp16 /
bf16 activation); otherwise the activation is rotated (fp32, rounded to its dtype) and quantized
by ``npu_dynamic_quant`` as before.

``aten::_int_mm`` must never be used on an NPU (it silently runs on the CPU). The weight operand is
``[K, N]``: for a canonical layer the ``w.t()`` view of the stored ``[N, K]`` weight (ND); for an
``int8_tensorwise_kn`` layer (the runtime sees ``q`` as the ``[N, K]`` transpose view of a
contiguous ``[K, N]`` tensor) the stored tensor itself, handed over as is, cast once at bind to
FRACTAL_NZ when ``K % 16 == 0`` and ``N % 32 == 0``; the ND tensor is then released (the layer
keeps only the NZ one, whose ``.t()`` view serves the dequantized fallback). ``npu_quant_matmul`` applies the
weight scale, the per-token scale and the bias itself, so its output is final: no rescale here
(rescaling it would apply the scales twice). Admission failures dequantize ON the NPU and run ``F.linear`` there;
nothing moves to the CPU.

``torch_npu`` is whatever module the probe imports (the real one, or the simulation in
``h3quant.testing.sim_npu``, which installs itself as ``sys.modules["torch_npu"]``).
"""

from __future__ import annotations

import dataclasses

import torch

from h3quant.errors import TpError
from h3quant.formats.int8_kn.tensors import NPU_MAX_N, NZ_FORMAT, nz_eligible
from h3quant.runtime.backends.base import (
    Backend,
    DequantizedLinear,
    Int8Weights,
    LinearOptions,
    Runner,
)
from h3quant.runtime.capabilities import Capability, Probe, npu_quant_capability
from h3quant.runtime.devices import Device
from h3quant.runtime.int8_math import rotate_activation

NPU_ACT_DTYPES = (torch.float16, torch.bfloat16)
NPU_K_MULTIPLE = 16
ROTATE_QUANT_SIZES = (16, 1024)  # npu_rotate_quant: rotation sizes it takes
ROTATE_QUANT_K_MULTIPLE = 8  # and the input width multiple
ROTATE_QUANT_INT8 = 1  # its int8 destination code


def rotate_quant_fits(torch_npu, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether ``torch_npu.npu_rotate_quant`` exists and takes a ``[M, k]`` activation of
    ``dtype`` rotated in groups of ``group_size``."""
    lo, hi = ROTATE_QUANT_SIZES
    return (getattr(torch_npu, "npu_rotate_quant", None) is not None
            and lo <= group_size <= hi and k % group_size == 0
            and k % ROTATE_QUANT_K_MULTIPLE == 0 and dtype in NPU_ACT_DTYPES)


def npu_layer_reasons(w: Int8Weights) -> list[str]:
    """Static admission checks for ``npu_quant_matmul`` (FORMATS.md section 6)."""
    n, k = w.out_features, w.in_features
    out = []
    if k % NPU_K_MULTIPLE:
        out.append(f"K={k} is not a multiple of {NPU_K_MULTIPLE}")
    if w.scale_vec.numel() not in (1, n):
        out.append(f"weight scale holds {w.scale_vec.numel()} values, need 1 or N={n}")
    if w.bias is not None and w.bias.numel() != n:
        out.append(f"bias holds {w.bias.numel()} values, need N={n}")
    if w.convrot and k % w.group_size:
        out.append(f"ConvRot group {w.group_size} does not divide K={k}")
    if n > NPU_MAX_N:
        out.append(f"N={n} exceeds the op's {NPU_MAX_N} outputs per rank")
    return out


def npu_call_reasons(x: torch.Tensor) -> list[str]:
    """Per-call admission: the activation must be fp16/bf16 and on the NPU."""
    out = []
    if x.dtype not in NPU_ACT_DTYPES:
        out.append(f"activation dtype {x.dtype} is not float16/bfloat16")
    if x.device.type != "npu":
        out.append(f"activation is on {x.device}, not npu")
    return out


def weight_operand(q: torch.Tensor, torch_npu) -> tuple[torch.Tensor, str]:
    """The ``[K, N]`` operand of ``npu_quant_matmul`` for int8 codes ``q`` seen as ``[N, K]``, and
    its storage format: no copy of a canonical weight (its ``.t()`` view, ND); a pre-transposed
    one as is, cast to FRACTAL_NZ when aligned (the only device-side relayout, done at bind)."""
    kn = q.t()
    if not kn.is_contiguous():
        return kn, "ND (transposed view)"
    n, k = q.shape
    if nz_eligible(n, k) and hasattr(torch_npu, "npu_format_cast"):
        return torch_npu.npu_format_cast(kn, NZ_FORMAT), "FRACTAL_NZ"
    return kn, "ND"


def npu_int32_matmul(torch_npu, q_x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``q_x [M, K] int8 @ w_t [K, N] int8`` -> the raw int32 accumulator, on the NPU.

    ``npu_quant_matmul(..., output_dtype=torch.int32)``: no per-token scale, no offset, no bias;
    the ``scale`` operand the op requires is all ones, so the result is the exact int32 sum
    whether or not a kernel applies it. Tensor parallel's shared-scale mode sums these partials
    across ranks (all_reduce SUM in int32) and scales once afterwards.
    """
    ones = torch.ones(w_t.shape[1], dtype=torch.float32, device=w_t.device)
    return torch_npu.npu_quant_matmul(q_x.contiguous(), w_t, ones, output_dtype=torch.int32)


class _NpuRunner(Runner):
    name = "npu"

    def __init__(self, w: Int8Weights, device: Device, torch_npu, options: LinearOptions) -> None:
        self.torch_npu = torch_npu
        self.w_t, self.weight_format = weight_operand(w.q, torch_npu)
        if self.weight_format == "FRACTAL_NZ":  # drop the ND tensor: keep one copy, the NZ one
            w = dataclasses.replace(w, q=self.w_t.t())
        super().__init__(w, device)
        self.scale = w.scale_vec.to(torch.float32).contiguous()
        # Fallback for inputs the kernel refuses: dequantized on the NPU, per call.
        self.fallback = DequantizedLinear(w, options, resident=False)
        self.fallback_calls = 0
        self.last_fallback_reason: str | None = None
        self._rotation: torch.Tensor | None = None  # H_g for npu_rotate_quant, made on first use
        self.rotate_quant_calls = 0

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate (ConvRot layers) and quantize per token: ``(q_x int8 [M, K], s_x fp32)``."""
        w = self.w
        if w.convrot and rotate_quant_fits(self.torch_npu, w.in_features, w.group_size, x.dtype):
            if self._rotation is None or self._rotation.dtype != x.dtype:
                from h3quant.convrot import hadamard
                self._rotation = hadamard(w.group_size, x.device).to(x.dtype).contiguous()
            self.rotate_quant_calls += 1
            return self.torch_npu.npu_rotate_quant(
                x.reshape(-1, w.in_features).contiguous(), self._rotation,
                dst_dtype=ROTATE_QUANT_INT8, axis=-1, round_mode="rint", scale_alg=0,
                dst_type_max=0.0, transpose_y=False)
        xr = rotate_activation(x, w.convrot, w.group_size).to(x.dtype) if w.convrot else x
        return self.torch_npu.npu_dynamic_quant(xr.reshape(-1, w.in_features).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        reasons = npu_call_reasons(x)
        if reasons:
            self.fallback_calls += 1
            self.last_fallback_reason = "; ".join(reasons)
            return self.fallback(x)
        w = self.w
        lead = x.shape[:-1]
        q_x, s_x = self._quantize(x)
        s_x = s_x.reshape(-1).clamp_min(1e-30)  # all-zero rows come back with scale 0
        bias = None if w.bias is None else w.bias.to(dtype=x.dtype).reshape(-1).contiguous()
        y = self.torch_npu.npu_quant_matmul(
            q_x, self.w_t, self.scale, pertoken_scale=s_x, bias=bias, output_dtype=x.dtype
        )
        # Final: the op applied s, s_x and the bias. Do NOT rescale.
        return y.reshape(*lead, w.out_features)


class NpuBackend(Backend):
    name = "npu"
    summary = "torch_npu.npu_dynamic_quant + npu_quant_matmul (Ascend)"

    def status(self, device: Device, probe: Probe) -> Capability:
        return npu_quant_capability(device, probe)

    def admit(self, w: Int8Weights, device: Device, probe: Probe) -> list[str]:
        return [f"npu_quant_matmul: {r}" for r in npu_layer_reasons(w)]

    def bind(self, w: Int8Weights, device: Device, probe: Probe, options: LinearOptions) -> Runner:
        return _NpuRunner(w, device, probe.npu_module(), options)

    def int32_matmul(self, device: Device, probe: Probe):

        mod = probe.npu_module()
        if mod is None:
            raise TpError("shared activation scale on npu needs torch_npu.npu_quant_matmul "
                          "(int32 output); torch_npu is not importable")
        return lambda q_x, w_t: npu_int32_matmul(mod, q_x, w_t)
