"""The MiniMax H3 DiT block, built from the real tensors of ``blocks.{i}`` (FORMATS.md 5.1).

What ``H3Block.forward(x, cond)`` computes for the packed sequence ``x`` [S, hidden] (batch 1):

    mod  = adaln_proj.linear(silu?(t_emb))             # [M, 18 * hidden], M distinct timesteps
           viewed as [3 M, 6 * hidden]: row 3 * t + modality (video 0, text 1, audio 2), chunked
           into shift/scale/gate (attention) and shift/scale/gate (MLP)
    h    = rmsnorm(x, norm1) * (1 + scale_msa[row]) + shift_msa[row]     per packed segment
    q, k, v = qkv_proj(h).split(A)                     # rows stored [q; k; v], heads = A / 128
    q, k = rmsnorm_head(q, q_norm), rmsnorm_head(k, k_norm), then split-half RoPE (96 dims)
    x    = x + gate_msa[row] * out_proj(softmax(q k^T / sqrt(d)) v)
    h    = rmsnorm(x, norm2) * (1 + scale_mlp[row]) + shift_mlp[row]
    x    = x + gate_mlp[row] * fc2(fc1(h), input_act="swiglu")          # fc1 rows [gate; up]

RMSNorm eps 1e-5. The pruned ("curve") form feeds fp32 time embeddings to an fp32 adaLN without
SiLU; the full form applies SiLU and runs adaLN in the compute dtype (``Conditioning``).

Linears are modules with ``forward(x, input_act=None)`` made by a ``make_linear(layer)`` factory
(``build_block``): a runtime ``QuantizedLinear``, a ``FloatLinear`` (stored float weight), a
``DequantLinear`` (the float math of a quantized layer's own weights), or a tensor-parallel shard.
The head count comes from the width qkv_proj actually returns, so a shard holding a slice of
the heads runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3quant.errors import VerifyError
from h3quant.runtime.loader import BLOCK_LINEARS, LoadedBlock, LoadedLayer
from h3quant.runtime.model.ops import (
    RMS_EPS,
    RopeTable,
    Segment,
    attention,
    gated_residual,
    modulate,
    qk_norm_rope,
    rms_norm,
    swiglu,
)

__all__ = ["RMS_EPS", "Conditioning", "DequantLinear", "FloatLinear", "H3Block", "attention",
           "build_block", "check_block_shapes", "quantized_linear", "reference_linear",
           "rms_norm", "runtime_block", "swiglu", "torch_device"]

MODULATION_CHUNKS = 6  # shift/scale/gate for attention, then for the MLP
MODALITIES = 3
ADALN_CHUNKS = MODULATION_CHUNKS * MODALITIES  # adaLN output = 18 * hidden
CHUNK_ELEMS = 1 << 24  # weight elements converted at once by the float reference linears


@dataclass(frozen=True)
class Conditioning:
    """What every block of one call shares.

    ``t_emb`` [M, t]: one time embedding per distinct timestep, already in ``adaln_dtype``;
    ``segments``: (start, stop, adaLN row) tiling the packed rows; ``rope``: cos/sin tables of
    the rows (None: no RoPE, as in the token refiner); ``adaln_silu``: SiLU before adaLN (full
    form only).
    """

    t_emb: torch.Tensor
    segments: list[Segment]
    rope: RopeTable | None
    adaln_silu: bool = False
    adaln_dtype: torch.dtype = torch.float32

    def to(self, device) -> "Conditioning":
        return Conditioning(self.t_emb.to(device), self.segments,
                            None if self.rope is None else self.rope.to(device),
                            self.adaln_silu, self.adaln_dtype)


def _apply_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    if input_act == "swiglu":
        return swiglu(x)
    if input_act is not None:
        raise VerifyError(f"unknown input activation {input_act!r}")
    return x


class FloatLinear(nn.Module):
    """A float linear in the activation dtype, weight kept as stored (e.g. BF16): it is cast in
    row chunks of ``CHUNK_ELEMS`` during the call, so no full-size copy is ever held."""

    backend_name = "float"
    weight: torch.Tensor  # buffers (declared for the type checker)
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        x = _apply_act(x, input_act)
        w, b = self.weight, self.bias
        n, k = w.shape
        if w.dtype == x.dtype or n * k <= CHUNK_ELEMS:
            return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        step = max(1, CHUNK_ELEMS // k)
        buf = torch.empty((min(step, n), k), dtype=x.dtype, device=x.device)
        for r0 in range(0, n, step):
            chunk = buf[:min(step, n - r0)]
            chunk.copy_(w[r0:r0 + step])  # into a reused buffer: no fresh pages per chunk
            bb = None if b is None else b[r0:r0 + step].to(x.dtype)
            out[..., r0:r0 + step] = F.linear(x, chunk, bb)
        return out


class DequantLinear(nn.Module):
    """The float math of a quantized layer's own weights, ``x W^T + b`` with ``W = (q * s) H_g``,
    without activation quantization: computed as ``(x H_g) (q * s)^T`` (H_g is symmetric and
    orthogonal), so the weight is never rotated and never held in float; codes are converted
    in row chunks. This is the reference of a run without ``--reference``."""

    backend_name = "dequant-ref"
    q: torch.Tensor  # buffers (declared for the type checker)
    s: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, layer: LoadedLayer, *, device=None):
        super().__init__()
        q, s = layer.int8_grid()
        self.register_buffer("q", q.to(device) if device is not None else q)
        self.register_buffer("s", s.to(device) if device is not None else s)
        b = layer.bias
        self.register_buffer("bias", None if b is None else b.to(self.q.device))
        self.convrot = layer.convrot
        self.group_size = layer.convrot_groupsize

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        x = _apply_act(x, input_act)
        xf = x.float()
        if self.convrot:
            from h3quant.convrot import rotate
            xf = rotate(xf, self.group_size)
        n, k = self.q.shape
        out = torch.empty((*x.shape[:-1], n), dtype=torch.float32, device=x.device)
        step = max(1, CHUNK_ELEMS // k)
        buf = torch.empty((min(step, n), k), dtype=torch.float32, device=x.device)
        for r0 in range(0, n, step):
            chunk = buf[:min(step, n - r0)]
            chunk.copy_(self.q[r0:r0 + step])
            out[..., r0:r0 + step] = F.linear(xf, chunk) * self.s[r0:r0 + step].float()
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype)


class H3Block(nn.Module):
    """The block above; ``linears`` maps each of BLOCK_LINEARS to a linear module; ``params``
    holds the float tensors (norms, adaLN) in their stored dtypes."""

    # buffers registered from ``params`` (dots become underscores), declared for the type checker
    norm1_weight: torch.Tensor
    norm2_weight: torch.Tensor
    attn_q_norm_weight: torch.Tensor
    attn_k_norm_weight: torch.Tensor
    adaln_proj_linear_weight: torch.Tensor
    adaln_proj_linear_bias: torch.Tensor

    def __init__(self, linears: dict[str, nn.Module], params: dict[str, torch.Tensor], *,
                 head_dim: int, index: int = 0):
        super().__init__()
        self.index = index
        self.qkv_proj = linears["attn.qkv_proj"]
        self.out_proj = linears["attn.out_proj"]
        self.fc1 = linears["mlp.fc1"]
        self.fc2 = linears["mlp.fc2"]
        for key, value in params.items():
            self.register_buffer(key.replace(".", "_"), value)
        self.hidden = int(params["norm1.weight"].shape[0])
        self.head_dim = head_dim
        self.t_dim = int(params["adaln_proj.linear.weight"].shape[1])

    def linears(self) -> dict[str, nn.Module]:
        return {"attn.qkv_proj": self.qkv_proj, "attn.out_proj": self.out_proj,
                "mlp.fc1": self.fc1, "mlp.fc2": self.fc2}

    def modulation(self, cond: Conditioning) -> tuple[torch.Tensor, ...]:
        """Six [3 M, hidden] tensors: shift/scale/gate (attention), shift/scale/gate (MLP)."""
        dt = cond.adaln_dtype
        t = cond.t_emb.to(dt)
        if cond.adaln_silu:
            t = F.silu(t)
        mod = F.linear(t, self.adaln_proj_linear_weight.to(dt), self.adaln_proj_linear_bias.to(dt))
        mod = mod.reshape(mod.shape[0] * MODALITIES, MODULATION_CHUNKS * self.hidden)
        return mod.chunk(MODULATION_CHUNKS, dim=-1)

    def attention(self, h: torch.Tensor, rope: RopeTable | None) -> torch.Tensor:
        return self_attention(h, self.qkv_proj, self.out_proj, self.attn_q_norm_weight,
                              self.attn_k_norm_weight, self.head_dim, rope)

    def forward(self, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``x`` [S, hidden] in the compute dtype; returns the new hidden state (same dtype)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise VerifyError(f"block input must be [rows, {self.hidden}], got {list(x.shape)}")
        sh1, sc1, g1, sh2, sc2, g2 = self.modulation(cond)
        segs = cond.segments
        h = modulate(rms_norm(x, self.norm1_weight), sh1, sc1, segs)
        x = gated_residual(x, g1, self.attention(h, cond.rope), segs)
        h = modulate(rms_norm(x, self.norm2_weight), sh2, sc2, segs)
        return gated_residual(x, g2, self.fc2(self.fc1(h), input_act="swiglu"), segs)


def self_attention(h: torch.Tensor, qkv_proj, out_proj, q_norm: torch.Tensor,
                   k_norm: torch.Tensor, head_dim: int, rope: RopeTable | None) -> torch.Tensor:
    """qkv -> per-head q/k RMSNorm (+ RoPE) -> softmax attention -> out_proj, for h [S, hidden]."""
    qkv = qkv_proj(h)
    width = qkv.shape[-1] // 3
    if qkv.shape[-1] % 3 or width % head_dim:
        raise VerifyError(f"qkv_proj returned {qkv.shape[-1]} columns: not 3 x heads x {head_dim}")
    s = h.shape[0]
    q, k, v = (z.reshape(s, width // head_dim, head_dim) for z in qkv.split(width, dim=-1))
    q, k = qk_norm_rope(q, k, q_norm, k_norm, rope)
    return out_proj(attention(q, k, v)).to(h.dtype)


# ------------------------------------------------------------------------------------- builders

_PARAMS = ("norm1.weight", "norm2.weight", "attn.q_norm.weight", "attn.k_norm.weight",
           "adaln_proj.linear.weight", "adaln_proj.linear.bias")


def check_block_shapes(block: LoadedBlock) -> int:
    """Check the block's tensors fit together; returns head_dim."""
    hidden = int(block.param("norm1.weight").shape[0])
    head_dim = int(block.param("attn.q_norm.weight").shape[0])
    qkv, out = block.linear("attn.qkv_proj"), block.linear("attn.out_proj")
    fc1, fc2 = block.linear("mlp.fc1"), block.linear("mlp.fc2")
    ada = block.param("adaln_proj.linear.weight")
    problems = []
    if qkv.in_features != hidden or qkv.out_features % 3:
        problems.append(f"qkv_proj is [{qkv.out_features}, {qkv.in_features}]")
    width = qkv.out_features // 3
    if head_dim == 0 or width % head_dim:
        problems.append(f"attention width {width} is not a multiple of head_dim {head_dim}")
    if (out.out_features, out.in_features) != (hidden, width):
        problems.append(f"out_proj is [{out.out_features}, {out.in_features}], expected "
                        f"[{hidden}, {width}]")
    if fc1.in_features != hidden or fc1.out_features != 2 * fc2.in_features \
            or fc2.out_features != hidden:
        problems.append(f"fc1 [{fc1.out_features}, {fc1.in_features}] and fc2 "
                        f"[{fc2.out_features}, {fc2.in_features}] do not chain [gate; up]")
    if ada.dim() != 2 or ada.shape[0] != ADALN_CHUNKS * hidden:
        problems.append(f"adaln_proj.linear.weight is {list(ada.shape)}, expected "
                        f"[{ADALN_CHUNKS * hidden}, t]")
    if problems:
        raise VerifyError("block tensors do not fit the H3 block: " + "; ".join(problems),
                          tensor=block.prefix)
    return head_dim


def build_block(block: LoadedBlock, make_linear, *, device=None) -> H3Block:
    """An H3Block whose linears are ``make_linear(layer: LoadedLayer)``; the float tensors keep
    their stored dtypes and move to ``device``."""
    head_dim = check_block_shapes(block)
    linears = {name: make_linear(block.linear(name)) for name in BLOCK_LINEARS}
    params = {k: block.param(k) for k in _PARAMS}
    if device is not None:
        params = {k: v.to(device) for k, v in params.items()}
    return H3Block(linears, params, head_dim=head_dim, index=block.index)


def torch_device(device) -> torch.device:
    """A ``torch.device`` from a runtime ``Device``, a ``torch.device`` or a string."""
    if hasattr(device, "torch_device"):
        return device.torch_device
    return torch.device(device)


def reference_linear(layer: LoadedLayer, *, device=None) -> nn.Module:
    """The float reference of a layer: its stored float weight, or the float math of its
    quantized weights (``DequantLinear``)."""
    if layer.decodes:  # fp8, mxfp8, ...: the codec's fp32 decode, float math
        dev = None if device is None else torch_device(device)
        w, bias = layer.dequantize(torch.float32), layer.bias
        return FloatLinear(w.to(dev) if dev else w,
                           None if bias is None else (bias.to(dev) if dev else bias))
    if layer.is_quantized:
        return DequantLinear(layer, device=device)
    bias = layer.bias
    dev = None if device is None else torch_device(device)
    return FloatLinear(layer.weight.to(dev) if dev else layer.weight,
                       None if bias is None else (bias.to(dev) if dev else bias))


def quantized_linear(layer: LoadedLayer, *, device, backend: str | None = None,
                     probe=None, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """The runtime module for a loaded layer: a QuantizedLinear (stored int8 codes and scales;
    W4A8 decoded once to its int8 grid) for a quantized layer, a FloatLinear (weight as stored)
    otherwise. ``device``: a runtime Device or a device string; ``probe``: see
    runtime.capabilities; ``compute_dtype``: the activation dtype (a backend that dequantizes
    keeps its weight in it)."""
    if not layer.is_quantized:
        tdev = torch_device(device)
        bias = None if layer.bias is None else layer.bias.to(tdev)
        return FloatLinear(layer.weight.to(tdev), bias)
    if layer.decodes:  # ComfyUI's path without a kernel: decode to the compute dtype, matmul
        from h3quant.runtime.decoded import DecodedLinear

        return DecodedLinear.from_layer(layer, device=device, probe=probe,
                                        compute_dtype=compute_dtype)
    from h3quant.runtime.backends import LinearOptions
    from h3quant.runtime.linear import QuantizedLinear
    q, s = layer.runtime_tensors()
    options = LinearOptions(compute_dtype=compute_dtype) if compute_dtype else None
    return QuantizedLinear.from_int8(
        q, s, convrot=layer.convrot,
        group_size=layer.convrot_groupsize, bias=layer.bias,
        full_precision=layer.full_precision, device=device, backend=backend, probe=probe,
        options=options)


def runtime_block(block: LoadedBlock, *, device, backend: str | None = None,
                  probe=None, compute_dtype: torch.dtype | None = None) -> H3Block:
    """The block as the runtime runs it: each linear on its selected backend."""
    return build_block(block, lambda lay: quantized_linear(lay, device=device, backend=backend,
                                                           probe=probe,
                                                           compute_dtype=compute_dtype),
                       device=torch_device(device))


def reference_block(block: LoadedBlock, *, device=None) -> H3Block:
    """The float reference of ``block`` (stored float weights; quantized layers as DequantLinear)."""
    return build_block(block, lambda lay: reference_linear(lay, device=device), device=device)
