"""Writing ``awq_w4a16`` from calibration statistics: activation-aware 4-bit weights.

comfy-kitchen's layout (``gemv_awq_w4a16``): ``qweight`` int8 [N, K/2] (two unsigned 4-bit codes
per byte, column 2j in the low nibble), ``wscales`` and ``wzeros`` [K/G, N] in the compute dtype,
and ``W[n, k] = (q - 8) * wscales[k // G, n] + wzeros[k // G, n]`` (per group asymmetric).

``encode_awq_w4a16(w, stats)`` (``stats``: an object with ``hessian()`` and ``feedback(...)``,
``h3quant.calibration``'s ``LayerStats``; the codec stores the three tensors as ``weight``,
``weight_scale`` and ``weight_zeros``):

1. per group, a clipping search: the group's range shrunk by each ratio of a grid, the scale and
   zero point that map it onto the 16 codes, and the one whose rounding error weighted by the
   inputs' per-channel energy (``diag H``: how much each input channel moves the output) is least;
   without statistics every channel weighs the same (plain min-max-with-clipping rounding);
2. the codes: round to nearest on the stored (rounded) scale and zero, or, with statistics, error
   feedback over ``H`` (``calibration.gptq``) on the same levels.

AWQ's per-input-channel scaling (weights multiplied by ``s_c``, activations divided by it) is
not in this module: the layout has no place for ``s``, so the division must be folded into the
layer before; ``scaling.py`` searches ``s`` for the layers where that is possible, and the
weight handed here is then ``W diag(s)`` with the statistics of the scaled inputs.
Identity (or no) statistics reproduce the uncalibrated tensors exactly.
"""

from __future__ import annotations

import torch

GROUP = 64  # comfy-kitchen's default group size
CLIP_GRID = 20  # ratios 1.0 down to 0.5


def _levels(c: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The decoded value of codes ``c`` (float, 0..15): kitchen's arithmetic in ``s``'s dtype."""
    return ((c.to(s.dtype) - 8.0) * s + z).float()


def _codes(v: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return ((v - z.float()) / s.float()).round_().add_(8.0).clamp_(0.0, 15.0)


def encode_awq_w4a16(w: torch.Tensor, stats=None, *, group_size: int = GROUP,
                     dtype: torch.dtype = torch.bfloat16, grid: int = CLIP_GRID,
                     feedback: bool = True, importance: torch.Tensor | None = None
                     ) -> dict[str, torch.Tensor]:
    """``{"qweight", "wscales", "wzeros"}`` of float ``w`` [N, K]; ``stats``: the layer's
    ``LayerStats`` (None: uncalibrated); ``feedback=False``: the weighted clipping search of the
    statistics but codes rounded to nearest (the channel-scale search's fast estimate);
    ``importance``: the per-channel weights of the clipping search (``diag H``) given directly,
    in place of the statistics' (the search passes them without building a scaled ``H``)."""
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    g = k // group_size
    wg = w.float().reshape(n, g, group_size)
    if importance is not None or stats is not None:
        d = importance if importance is not None else stats.hessian().diagonal()
        imp = d.float().clamp(min=0).reshape(1, g, group_size)
        imp = imp / imp.mean().clamp(min=1e-30)
    else:
        imp = torch.ones(1, g, group_size)
    wmax, wmin = wg.amax(-1), wg.amin(-1)
    best = torch.full((n, g), float("inf"))
    s_best = torch.empty(n, g, dtype=dtype)
    z_best = torch.empty(n, g, dtype=dtype)
    for r in torch.linspace(1.0, 0.5, grid).tolist():
        hi, lo = wmax * r, wmin * r
        s = ((hi - lo) / 15.0).clamp_(min=1e-8).to(dtype)
        z = (lo + 8.0 * s.float()).to(dtype)
        c = _codes(wg, s.unsqueeze(-1), z.unsqueeze(-1))
        err = ((_levels(c, s.unsqueeze(-1), z.unsqueeze(-1)) - wg) ** 2 * imp).sum(-1)
        better = err < best
        best = torch.where(better, err, best)
        s_best = torch.where(better, s, s_best)
        z_best = torch.where(better, z, z_best)
    if stats is None or not feedback:  # rounded to nearest on the chosen levels
        codes = _codes(wg, s_best.unsqueeze(-1), z_best.unsqueeze(-1)).reshape(n, k)
    else:
        def quantize(v: torch.Tensor, j: int):
            s, z = s_best[:, j // group_size], z_best[:, j // group_size]
            c = _codes(v, s, z)
            return c, _levels(c, s, z)

        codes = stats.feedback(w.float(), quantize, convrot=False)
    c = codes.to(torch.uint8)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).view(torch.int8)
    return {"qweight": packed.contiguous(), "wscales": s_best.t().contiguous(),
            "wzeros": z_best.t().contiguous()}


def decode_awq_w4a16(t: dict, group_size: int = GROUP) -> torch.Tensor:
    """fp32 [N, K] of ``encode_awq_w4a16``'s tensors (the layout's formula)."""
    p = t["qweight"].view(torch.uint8)
    n = p.shape[0]
    c = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(n, -1)
    s = t["wscales"].t().repeat_interleave(group_size, dim=1)
    z = t["wzeros"].t().repeat_interleave(group_size, dim=1)
    return _levels(c.float(), s, z)


__all__ = ["GROUP", "decode_awq_w4a16", "encode_awq_w4a16"]
