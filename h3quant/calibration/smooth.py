"""Smoothing (SmoothQuant class): activation outliers moved into the weights, folded exactly.

A linear ``y = x W^T`` computes the same with ``W' = W diag(s)`` on ``x' = x / s``. Where the
format quantizes activations (int4 per token for INT4 ConvRot, int8 per token for W4A8 and
int8), channels with large ``|x|`` set every token's scale; dividing them by ``s`` and
multiplying the weight's columns by ``s`` moves that range into the weight, which is quantized
per row (and, for ConvRot, rotated after the scaling: smooth first, then rotate).

In an H3 block every linear's input is produced by float tensors of the same block, so the
division is folded exactly into them (``fold_block``; ComfyUI's ``DiTBlock.forward``:
``h = rmsnorm(x) * norm.weight * (1 + scale) + shift`` with shift and scale rows of the
adaLN projection):

* ``attn.qkv_proj``: ``norm1.weight / s`` and the ``shift_msa`` rows of ``adaln_proj.linear``
  (weight and bias, for each of the three modalities) ``/ s``;
* ``mlp.fc1``: ``norm2.weight`` and the ``shift_mlp`` rows, the same way;
* ``attn.out_proj``: the v rows of ``qkv_proj`` ``/ s`` (attention is linear in v);
* ``mlp.fc2``: the up rows of ``fc1`` ``/ s`` (``silu(gate) * up`` is linear in up).

Every factor is a power of two, so each fold is exact in any float dtype (BF16 included):
the smoothed float checkpoint computes what the original does, to the last rounding of its
own arithmetic.

``choose`` picks a layer's factors: ``s = max|x|^a / max|w|^(1 - a)`` per input channel
(channel maxima from the statistics, the weight's column maxima), normalised by its geometric
mean and rounded to a power of two, for each ``a`` in ``ALPHAS``. Each candidate is judged by
the layer's output error as the target format's default CPU path computes it: the weight
encoded by the format (rounding to nearest, on up to ``SEARCH_ROWS`` output rows), the
statistics' sampled input rows divided by ``s`` and run through the format's activation path
(ConvRot rotation and per-token int4 or int8 rounding, or a float decode), against the float
output. The weight's part of that error is weighted by ``weight_share`` (error feedback shrinks
it; the caller passes its predicted factor). A layer is smoothed only where the best candidate
lowers that modelled error by at least ``MIN_GAIN_DB``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ALPHAS = tuple(i / 16 for i in range(1, 17))  # 1/16 .. 1
MIN_GAIN_DB = 0.2  # a smaller modelled gain leaves the layer unsmoothed
MAX_EXP = 8  # factors within 2^-8 .. 2^8
SEARCH_ROWS = 256  # output rows of the weight encoded per candidate

SMOOTHED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
MODULATION_CHUNKS = 6  # adaLN: shift/scale/gate (attention), shift/scale/gate (MLP)
MODALITIES = 3
SHIFT_CHUNK = {"attn.qkv_proj": 0, "mlp.fc1": 3}  # shift_msa, shift_mlp
NORM_OF = {"attn.qkv_proj": "norm1.weight", "mlp.fc1": "norm2.weight"}
ROWS_OF = {"attn.out_proj": ("attn.qkv_proj", 3), "mlp.fc2": ("mlp.fc1", 2)}  # last 1/parts


@dataclass
class Choice:
    """A layer's smoothing: ``s`` (None: not smoothed), the exponent and the modelled errors."""

    s: torch.Tensor | None
    alpha: float = 0.0
    modelled_db: dict = field(default_factory=dict)  # output SQNR: plain / smoothed (dB)
    note: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"smoothed": self.s is not None, "alpha": self.alpha,
                     "modelled_output_sqnr_db": self.modelled_db}
        if self.s is not None:
            e = torch.log2(self.s)
            out["exponents"] = {"min": int(e.min()), "max": int(e.max())}
        if self.note:
            out["note"] = self.note
        return out


def power_of_two(s: torch.Tensor) -> torch.Tensor:
    """``s`` rounded (in log2) to the nearest power of two within ``2^+-MAX_EXP`` (fp32)."""
    e = torch.log2(s.to(torch.float64)).round().clamp(-MAX_EXP, MAX_EXP)
    return torch.pow(2.0, e).to(torch.float32)


def factors(x_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """``max|x|^a / max|w|^(1 - a)`` per input channel, over its geometric mean, as powers of
    two; channels with no activation or no weight get 1."""
    xm = x_max.to(torch.float64)
    wm = w.to(torch.float64).abs().amax(0)
    live = (xm > 0) & (wm > 0)
    s = torch.ones_like(xm)
    if bool(live.any()):
        raw = xm[live] ** alpha / wm[live] ** (1.0 - alpha)
        s[live] = raw / torch.exp(torch.log(raw).mean())
    return power_of_two(s)


def runtime_output(codec, marker: dict | None, tensors: dict, x: torch.Tensor) -> torch.Tensor:
    """``x W^T`` (fp32 ``x [M, K]``) as the runtime's default CPU path runs a layer of ``codec``:
    comfy-kitchen's emulated forward where ComfyUI runs one on the CPU (INT4 ConvRot: int4
    activations), the float decode for formats run dequantized, else the int8 grid with
    per-token int8 activations (ConvRot-rotated where the marker says)."""
    emulation = codec.spec.runtime.emulation
    if emulation is not None and "cpu" in emulation[1]:
        return codec.emulator.emulated_linear(x, tensors, marker or {}).float()
    if codec.spec.runtime.decodes and hasattr(codec.decoder, "decode_weight"):
        return x @ codec.decoder.decode_weight(tensors, marker or {}, torch.float32).t()
    from h3quant.runtime.int8_math import quantize_activation

    q, s = codec.grid.int8_grid(tensors, marker or {})
    convrot = codec.spec.reading.uses_convrot(marker)
    g = int((marker or {}).get("convrot_groupsize", 256))
    qx, sx = quantize_activation(x, convrot, g)
    return (qx.float() @ q.float().t()) * sx[:, None] * s.float().reshape(1, -1)


def _errors(codec, marker, w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor,
            s: torch.Tensor | None) -> tuple[float, float]:
    """(weight part, activation part) of the output error energy on the sampled rows."""
    ws = w if s is None else w * s
    xs = x if s is None else x / s
    out = codec.encoder.encode(ws.contiguous(), marker, "exact")
    w_hat, _ = codec.encoder.report_grid(out, marker or {})
    y_w = xs @ w_hat.float().t()  # quantized weight, float activations
    y = runtime_output(codec, marker, out, xs)
    return float(((y_w - ref) ** 2).sum()), float(((y - y_w) ** 2).sum())


def _db(signal: float, noise: float) -> float:
    return 10.0 * math.log10(max(signal, 1e-300) / noise) if noise > 0 else math.inf


def choose(w: torch.Tensor, x_max: torch.Tensor, sample: torch.Tensor, codec, marker, *,
           weight_share: float = 1.0, alphas=ALPHAS, min_gain_db: float = MIN_GAIN_DB,
           rows: int = SEARCH_ROWS) -> Choice:
    """The smoothing of one linear (see the module text): ``w`` [N, K] float weight, ``x_max``
    [K] the max ``|x|`` per input channel, ``sample`` [S, K] input rows, ``codec`` / ``marker``
    the layer's target; ``weight_share`` in (0, 1] weights the weight's part of the error."""
    w = w.float()
    n = w.shape[0]
    pick = torch.linspace(0, n - 1, min(rows, n)).round().long().unique()
    wsub = w[pick]
    x = sample.float()
    if x.shape[0] == 0:
        return Choice(None, note="no sampled rows: not smoothed")
    ref = x @ wsub.t()
    signal = float((ref ** 2).sum())

    def model(s):
        ew, ea = _errors(codec, marker, wsub, x, ref, s)
        return weight_share * ew + ea

    plain = model(None)
    best, best_alpha, best_err = None, 0.0, plain
    tried: set[bytes] = set()
    for a in alphas:
        s = factors(x_max, w, a)
        key = s.numpy().tobytes()
        if bool((s == 1).all()) or key in tried:
            continue
        tried.add(key)
        err = model(s)
        if err < best_err:
            best, best_alpha, best_err = s, a, err
    dbs = {"plain": round(_db(signal, plain), 3), "smoothed": round(_db(signal, best_err), 3)}
    if best is None or _db(signal, best_err) - _db(signal, plain) < min_gain_db:
        return Choice(None, 0.0, dbs, note=f"modelled gain below {min_gain_db} dB: not smoothed")
    return Choice(best, best_alpha, dbs)


def choose_for_target(w: torch.Tensor, x_max: torch.Tensor, sample: torch.Tensor, target: str,
                      group_size: int = 256, **kw) -> Choice:
    """``choose`` for a ``convert --to`` target name (``int4-convrot``, ``w4a8``, ``int8``,
    ``int8-convrot``, ``nvfp4`` ...) with its marker at ``group_size``. The caller folds
    ``1 / choice.s`` into whatever produces the layer's input (a norm's weight and bias, the
    rows of the linear before) and quantizes ``w * choice.s``."""
    from h3quant.formats import registry

    codec = registry.target_codec(target)
    return choose(w, x_max, sample, codec, codec.spec.planning.marker(registry.target(target), group_size),
                  **kw)


# ----------------------------------------------------------------------------------- the fold

def shift_rows(linear: str, hidden: int) -> list[tuple[int, int]]:
    """The adaLN output rows (``adaln_proj.linear``) that are the shift feeding ``linear``
    (qkv_proj: shift_msa, fc1: shift_mlp), one range per modality."""
    c = SHIFT_CHUNK[linear]
    per = MODULATION_CHUNKS * hidden
    return [(m * per + c * hidden, m * per + (c + 1) * hidden) for m in range(MODALITIES)]


def fold_plan(factors_of: dict[str, torch.Tensor], hidden: int, qkv_rows: int, fc1_rows: int
              ) -> dict[str, list]:
    """What ``fold_block`` does to each tensor of a block (names relative to the block):
    ``("cols", s)`` multiplies the columns, ``("rows", r0, r1, d)`` divides rows ``[r0, r1)``
    by ``d`` (or the whole vector for a 1-D tensor)."""
    ops: dict[str, list] = {}
    for lin, s in factors_of.items():
        ops.setdefault(f"{lin}.weight", []).append(("cols", s))
        if lin in NORM_OF:
            ops.setdefault(NORM_OF[lin], []).append(("rows", 0, hidden, s))
            for r0, r1 in shift_rows(lin, hidden):
                for t in ("adaln_proj.linear.weight", "adaln_proj.linear.bias"):
                    ops.setdefault(t, []).append(("rows", r0, r1, s))
        else:
            pred, parts = ROWS_OF[lin]
            n = qkv_rows if pred == "attn.qkv_proj" else fc1_rows
            k = n // parts
            for t in (f"{pred}.weight", f"{pred}.bias"):
                ops.setdefault(t, []).append(("rows", n - k, n, s))
    return ops


def apply_ops(t: torch.Tensor, ops: list) -> torch.Tensor:
    """``t`` (any float dtype) with the fold operations applied; powers of two, so exact."""
    out = t.clone()
    for op in ops:
        if op[0] == "cols":
            out = (out * op[1].to(out.dtype)).to(t.dtype)
        else:
            _, r0, r1, d = op
            d = d.to(out.dtype)
            out[r0:r1] = out[r0:r1] / (d[:, None] if out.dim() == 2 else d)
    return out


def fold_block(tensors: dict[str, torch.Tensor], factors_of: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """One block's float tensors (names relative to the block: ``norm1.weight``,
    ``adaln_proj.linear.weight``, ``attn.qkv_proj.weight`` ...) with the smoothing factors
    ``factors_of`` (linear -> ``s`` [K], powers of two) folded in: each smoothed linear's
    weight is ``W diag(s)`` and what produces its input is divided by ``s``. Returns the
    changed tensors only."""
    hidden = int(tensors["norm1.weight"].shape[0])
    ops = fold_plan(factors_of, hidden, int(tensors["attn.qkv_proj.weight"].shape[0]),
                    int(tensors["mlp.fc1.weight"].shape[0]))
    return {name: apply_ops(tensors[name], o) for name, o in ops.items() if name in tensors}


__all__ = ["ALPHAS", "Choice", "MIN_GAIN_DB", "SMOOTHED", "apply_ops", "choose",
           "choose_for_target", "factors",
           "fold_block", "fold_plan", "power_of_two", "runtime_output", "shift_rows"]
