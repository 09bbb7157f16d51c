"""Per-layer error report of a conversion.

Cost control: every metric is computed on ``REPORT_ROWS`` (256) evenly spaced rows of each layer
(all rows when N <= 256), kept while the layer was converted, so the report never re-reads or
re-rotates a whole weight. Row-wise scales make a row subset an exact sample of the stored rows.

- weight error: relative L2 ``||W - W_hat|| / ||W||``, SQNR ``20 log10(||W|| / ||W - W_hat||)``
  dB and cosine, between the source weight rows (the input weight, dequantized when the input was
  quantized) and the dequantized output rows;
- output error: relative L2 of ``y = x W_hat^T`` computed the way the runtime does (ConvRot of x,
  per-token int8 activation quantization, ``torch._int_mm`` int32 accumulation, both scales) vs
  the float ``x W^T``, for ``x`` = 64 tokens of seeded standard normal activations. For bf16
  output it is the float product with the bf16 weight.
"""

from __future__ import annotations

import torch

from h3quant.pipelines.convert.options import REPORT_SEED, REPORT_TOKENS
from h3quant.pipelines.metrics import error_metrics
from h3quant.runtime.int8_math import quantize_activation, scale_accumulator

_X_CACHE: dict[int, torch.Tensor] = {}


def activation(k: int) -> torch.Tensor:
    """The seeded random activation [64, K] used for every layer of width K."""
    if k not in _X_CACHE:
        gen = torch.Generator().manual_seed(REPORT_SEED + k)
        _X_CACHE[k] = torch.randn(REPORT_TOKENS, k, generator=gen, dtype=torch.float32)
    return _X_CACHE[k]


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, convrot: bool,
                group_size: int) -> torch.Tensor:
    """The runtime W8A8 product (FORMATS.md 3.2) of fp32 ``x`` [M, K] with int8 ``q`` [N, K]."""
    q_x, s_x = quantize_activation(x, convrot, group_size)
    acc = torch._int_mm(q_x.contiguous(), q.contiguous().t())  # column-major B: the fast path
    return scale_accumulator(acc, s_x, s.reshape(-1), torch.float32)


def layer_metrics(codec, lp, ref: torch.Tensor, out: dict) -> dict:
    """Metrics of one converted layer from its sampled rows (see the module docstring)."""
    x = activation(lp.k)
    y_ref = x @ ref.t()
    w_hat, grid = codec.encoder.report_grid(out, lp.out_fields or {})
    if grid is None:
        y = x @ w_hat.t()
    else:
        q, s, convrot, g = grid
        y = int8_linear(x, q, s, convrot=convrot, group_size=g)
    rel, sqnr, cos = error_metrics(w_hat, ref)
    return {"weight_rel_l2": rel, "sqnr_db": sqnr, "cosine": cos,
            "output_rel_l2": error_metrics(y, y_ref)[0], "rows_sampled": int(ref.shape[0])}
