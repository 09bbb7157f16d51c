"""Benchmark: int8 linear (torch._int_mm path, with activation rotation + quantization) vs bf16
F.linear on CPU, at the H3 block shapes, measured side by side in one run.

To keep the run short, the weight-dependent work (the matmuls, the rescale, the weight
dequantization) is timed on ``--n-slice`` output rows and scaled linearly to the full N; the
activation rotation + quantization (independent of N) is timed in full. ``--n-slice 0`` times the
full weight (slow on CPUs without VNNI: _int_mm can run at ~1 GOPS there).

    python bench/bench_int8_linear.py                      # all four shapes, M = 1024 and 4096
    python bench/bench_int8_linear.py --shapes fc1 --tokens 4096 --n-slice 512
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from h3quant.runtime.int8_math import dequantize_weight, quantize_activation, scale_accumulator
from h3quant.runtime.linear import QuantizedLinear

SHAPES = {  # name: (N, K)
    "qkv": (21504, 5376),
    "out_proj": (5376, 7168),
    "fc1": (28672, 5376),
    "fc2": (5376, 14336),
}
G = 256


CLOCK = time.perf_counter


def timed(fn, repeat: int) -> float:
    """Best time of ``repeat`` runs, in seconds, on ``CLOCK`` (wall, or process CPU time)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def warm_up() -> None:
    q = torch.randint(-128, 128, (64, 256), dtype=torch.int8)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    q_x, _ = quantize_activation(x, True, G)
    torch._int_mm(q_x, q.t())
    F.linear(x, torch.randn(64, 256, dtype=torch.bfloat16))
    dequantize_weight(q, torch.ones(64), True, G, torch.bfloat16)


def bench_one(name: str, m: int, n_slice: int, repeat: int, seed: int) -> dict:
    n_full, k = SHAPES[name]
    n = n_full if n_slice <= 0 else min(n_slice, n_full)
    scale_up = n_full / n
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, 1, generator=g) * 1e-3 + 1e-4
    x = torch.randn(m, k, generator=g, dtype=torch.bfloat16)
    w_bf16 = dequantize_weight(q, s.reshape(-1), True, G, torch.bfloat16)

    holder = {}
    t_prep = timed(lambda: holder.update(qa=quantize_activation(x, True, G)), repeat)
    q_x, s_x = holder["qa"]
    w_t = q.t()
    t_mm = timed(lambda: holder.update(acc=torch._int_mm(q_x, w_t)), repeat)
    t_scale = timed(lambda: scale_accumulator(holder["acc"], s_x, s.reshape(-1), torch.bfloat16), repeat)
    t_bf16 = timed(lambda: F.linear(x, w_bf16), repeat)
    x32, w32 = x.float(), w_bf16.float()
    t_fp32 = timed(lambda: F.linear(x32, w32), repeat)
    t_deq = timed(lambda: dequantize_weight(q, s.reshape(-1), True, G, torch.bfloat16), repeat)
    cached = QuantizedLinear.from_int8(q, s, convrot=True, backend="dequant")
    t_cached = timed(lambda: cached(x), repeat)

    int8_total = t_prep + (t_mm + t_scale) * scale_up
    bf16_total = t_bf16 * scale_up
    return {
        "name": name, "m": m, "n": n, "n_full": n_full, "k": k,
        "prep": t_prep, "mm": t_mm * scale_up, "scale": t_scale * scale_up,
        "int8": int8_total, "bf16": bf16_total, "fp32": t_fp32 * scale_up,
        "dequant_cached": t_cached * scale_up,
        "dequant_per_call": (t_cached + t_deq) * scale_up,
        "dequant_weight": t_deq * scale_up,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,out_proj,fc1,fc2",
                    help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1024,4096", help="comma list of M (tokens)")
    ap.add_argument("--n-slice", type=int, default=256,
                    help="output rows timed (scaled to N); 0 = full weight")
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement (best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or process CPU time (steadier on a shared machine; "
                         "sums all threads, so use it with --threads 1)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, n-slice {args.n_slice}, "
          f"clock {args.clock}")
    print(f"{args.clock} ms for the FULL layer (weight-side work scaled from the timed slice)")
    head = (f"{'layer':9} {'M':>5} {'N x K':>13} {'prep':>8} {'int_mm':>9} {'scale':>7} "
            f"{'int8':>9} {'bf16':>9} {'int8/bf16':>9} {'deq.cached':>10} {'deq.call':>9} "
            f"{'deq/bf16':>8} {'fp32':>9}")
    print(head)
    print("-" * len(head))
    warm_up()
    t0 = time.perf_counter()
    for name in names:
        for m in tokens:
            r = bench_one(name, m, args.n_slice, args.repeat, seed=len(name) * 131 + m)
            ms = {k: v * 1e3 for k, v in r.items() if isinstance(v, float)}
            print(f"{name:9} {m:5d} {r['n_full']:6d}x{r['k']:<6d} {ms['prep']:8.1f} {ms['mm']:9.1f} "
                  f"{ms['scale']:7.1f} {ms['int8']:9.1f} {ms['bf16']:9.1f} "
                  f"{r['int8'] / r['bf16']:9.2f} {ms['dequant_cached']:10.1f} "
                  f"{ms['dequant_per_call']:9.1f} {r['dequant_per_call'] / r['bf16']:8.2f} "
                  f"{ms['fp32']:9.1f}",
                  flush=True)
    print(f"\nprep = ConvRot rotation + per-token int8 quantization of x (fp32); int8 = prep + "
          f"int_mm + scale; deq.cached = dequant backend with the weight dequantized at load; "
          f"deq.call = dequantized per call; fp32 = F.linear in fp32 for context. "
          f"Bench wall time {time.perf_counter() - t0:.1f} s.")


if __name__ == "__main__":
    main()
