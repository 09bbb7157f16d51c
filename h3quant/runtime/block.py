"""A minimal MiniMax H3 DiT block built from the real tensors of ``blocks.{i}`` (FORMATS.md 5).

Enough of the block to exercise every quantized linear the way the model chains them:

    mod = adaln_proj(temb)                        # [18 * hidden]; chunks 0..5 used, see below
    h   = rmsnorm(x, norm1) * (1 + scale1) + shift1
    q, k, v = qkv_proj(h).split(A)                # rows stored [q; k; v], A = heads * head_dim
    q, k = rmsnorm_head(q, q_norm), rmsnorm_head(k, k_norm)
    x   = x + gate1 * out_proj(attention(q, k, v))        # softmax(q k^T / sqrt(d)) v
    h   = rmsnorm(x, norm2) * (1 + scale2) + shift2
    x   = x + gate2 * fc2(fc1(h), input_act="swiglu")   # fc1 rows [gate; up]; SwiGLU fused in fc2

Simplifications (this block checks numerics, it is not the model):
- Timestep embedding: ``temb`` is a fixed seeded N(0, 1) vector of width t (the adaLN input
  width), standing in for the time embedder / ``adaln_t_table`` lookup; SiLU is applied before
  ``adaln_proj`` as DiT conditioning does.
- adaLN: the 18 * hidden output is cut into 18 hidden-wide chunks; chunks 0..5 are used as
  (shift1, scale1, gate1, shift2, scale2, gate2). The other 12 (the model's other streams and
  cross paths) are computed but unused.
- Self-attention only, no RoPE, no mask, one stream of tokens; the attention is the math of
  ``F.scaled_dot_product_attention`` written out in fp32 (see ``attention``).
Linears are any module with ``forward(x, input_act=None)``: a runtime ``QuantizedLinear`` or
``FloatLinear`` below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from h3quant.errors import VerifyError
from h3quant.runtime.loader import BLOCK_LINEARS, LoadedBlock, LoadedLayer

ADALN_CHUNKS = 18
USED_CHUNKS = ("shift1", "scale1", "gate1", "shift2", "scale2", "gate2")  # chunks 0..5
RMS_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` over [B, H, T, D], in fp32, result in q's dtype.

    This is what ``F.scaled_dot_product_attention`` computes (no mask, no dropout; the tests pin
    the two together on the CPU), written out so that it runs the same on every device, the
    simulated MPS/NPU devices included (SDPA's fused-kernel choice rejects them), and in fp32
    whatever the activation dtype.
    """
    qf, kf, vf = q.float(), k.float(), v.float()
    w = torch.softmax(qf @ kf.transpose(-2, -1) * (q.shape[-1] ** -0.5), dim=-1)
    return (w @ vf).to(q.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the two contiguous halves ``[gate | up]`` of the last dim."""
    if x.shape[-1] % 2:
        raise VerifyError(f"SwiGLU input width {x.shape[-1]} is odd")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class FloatLinear(nn.Module):
    """A plain float linear with the same call signature as the runtime's QuantizedLinear."""

    backend_name = "float"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        if input_act == "swiglu":
            x = swiglu(x)
        elif input_act is not None:
            raise VerifyError(f"unknown input activation {input_act!r}")
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


class H3Block(nn.Module):
    """The block above; ``linears`` maps each of BLOCK_LINEARS to a linear module."""

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

    def modulation(self, temb: torch.Tensor) -> dict[str, torch.Tensor]:
        mod = F.linear(F.silu(temb.float()), self.adaln_proj_linear_weight.float(),
                       self.adaln_proj_linear_bias.float())
        chunks = mod.chunk(ADALN_CHUNKS, dim=-1)
        return {name: chunks[i] for i, name in enumerate(USED_CHUNKS)}

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, hidden], ``temb`` [B, t] or [t]; returns [B, T, hidden] in x's dtype."""
        dt = x.dtype
        m = {k: v.to(dt).reshape(-1, 1, self.hidden) for k, v in self.modulation(temb).items()}
        b, t, _ = x.shape
        h = rms_norm(x, self.norm1_weight) * (1 + m["scale1"]) + m["shift1"]
        qkv = self.qkv_proj(h)
        width = qkv.shape[-1] // 3
        heads = width // self.head_dim
        q, k, v = (z.reshape(b, t, heads, self.head_dim) for z in qkv.split(width, dim=-1))
        q = rms_norm(q, self.attn_q_norm_weight).transpose(1, 2)
        k = rms_norm(k, self.attn_k_norm_weight).transpose(1, 2)
        v = v.transpose(1, 2)
        a = attention(q, k, v).transpose(1, 2).reshape(b, t, width)
        x = x + m["gate1"] * self.out_proj(a).to(dt)
        h = rms_norm(x, self.norm2_weight) * (1 + m["scale2"]) + m["shift2"]
        x = x + m["gate2"] * self.fc2(self.fc1(h), input_act="swiglu").to(dt)
        return x


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


def block_params(block: LoadedBlock) -> dict[str, torch.Tensor]:
    return {key: block.param(key).float() for key in _PARAMS}


def build_block(block: LoadedBlock, make_linear, *, device=None) -> H3Block:
    """An H3Block whose linears are ``make_linear(layer: LoadedLayer)``; float params on device."""
    head_dim = check_block_shapes(block)
    linears = {name: make_linear(block.linear(name)) for name in BLOCK_LINEARS}
    params = {k: v.to(device) if device is not None else v for k, v in block_params(block).items()}
    return H3Block(linears, params, head_dim=head_dim, index=block.index)


def float_linear(layer: LoadedLayer, *, device=None) -> FloatLinear:
    """fp32 reference linear: the dequantized weight of a quantized layer, or the float weight."""
    bias = None if layer.bias is None else layer.bias.float().to(device)
    return FloatLinear(layer.dequantize(torch.float32).to(device), bias)


def reference_block(block: LoadedBlock, *, device=None) -> H3Block:
    """The float fp32 version of ``block`` (dequantized weights for quantized layers)."""
    return build_block(block, lambda lay: float_linear(lay, device=device), device=device)


def torch_device(device) -> torch.device:
    """A ``torch.device`` from a runtime ``Device``, a ``torch.device`` or a string."""
    if hasattr(device, "torch_device"):
        return device.torch_device
    return torch.device(device)


def quantized_linear(layer: LoadedLayer, *, device, backend: str | None = None,
                     probe=None) -> nn.Module:
    """The runtime module for a loaded layer: a QuantizedLinear (stored int8 codes and scales;
    W4A8 decoded once to its int8 grid) for a quantized layer, a FloatLinear (weight as stored)
    otherwise. ``device``: a runtime Device or a device string; ``probe``: see runtime.capabilities."""
    if not layer.is_quantized:
        tdev = torch_device(device)
        bias = None if layer.bias is None else layer.bias.to(tdev)
        return FloatLinear(layer.weight.to(tdev), bias)
    from h3quant.runtime.linear import QuantizedLinear
    q, s = layer.runtime_tensors()
    return QuantizedLinear.from_int8(
        q, s, convrot=layer.convrot or layer.format.value == "asym_w4a8_int8",
        group_size=layer.convrot_groupsize, bias=layer.bias,
        full_precision=layer.full_precision, device=device, backend=backend, probe=probe)


def runtime_block(block: LoadedBlock, *, device, backend: str | None = None,
                  probe=None) -> H3Block:
    """The block as the runtime runs it: each linear on its selected backend."""
    return build_block(block, lambda lay: quantized_linear(lay, device=device, backend=backend,
                                                           probe=probe),
                       device=torch_device(device))


def seeded_inputs(block: H3Block, tokens: int, seed: int, *, batch: int = 1,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [batch, tokens, hidden], temb [batch, t]) from a CPU generator: same values anywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, block.hidden, generator=g)
    temb = torch.randn(batch, block.t_dim, generator=g)
    return x.to(dtype), temb
