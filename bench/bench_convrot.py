"""Throughput of the int8 ConvRot encoder (and the bare rotations) on full-size H3 weights.

Prints seconds and MB/s of bf16 input per method, side by side in one run:
  exact  bit-identical to comfy-kitchen (half-size dense matmuls where the BLAS allows)
  dense  kitchen's own g x g matmul per block
  fast   fast rotation (two 16-point matmuls), not bit-exact
plus the peak extra RSS during each encode (the int8 output, half the bf16 size, included).
CPU time is printed too: wall time is unreliable on a shared machine. Nothing is asserted.

    python bench/bench_convrot.py [--shapes 28672x5376,5376x14336]
        [--methods exact,dense,fast] [--repeat 1] [--threads N] [--rotate]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from h3quant.convrot import rotate, rotate_dense, rotate_exact
from h3quant.convrot.rotation import halves_match_dense
from h3quant.formats.int8.tensors import encode_int8


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM (peak RSS) to the current RSS
    except OSError:
        pass


def _weight(n: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w = torch.empty(n, k, dtype=torch.bfloat16)
    step = max(1, (1 << 22) // k)
    for i in range(0, n, step):  # fill in chunks: no full fp32 copy in the baseline RSS
        w[i:i + step] = torch.randn(min(step, n - i), k, generator=gen) * 0.02
    w[:, :: k // 4] *= 50  # a few outlier input columns
    return w


def _time(fn, repeat: int) -> tuple[float, float]:
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="28672x5376,5376x14336")
    ap.add_argument("--methods", default="exact,dense,fast")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--rotate", action="store_true",
                    help="also time rotate / rotate_exact / rotate_dense alone")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"half-size exact path: {halves_match_dense(256)}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        w = _weight(n, k)
        mb = w.numel() * 2 / 1e6
        print(f"\n[{n}, {k}] bf16 = {mb:.0f} MB")
        for method in args.methods.split(","):
            _reset_peak()
            base = _status_mb("VmRSS")
            wall, cpu = _time(lambda: encode_int8(w, method=method), args.repeat)
            extra = max(0.0, _status_mb("VmHWM") - base)
            print(f"  encode {method:5s}: {wall:7.2f} s  {mb / wall:7.0f} MB/s   cpu {cpu:7.2f} s "
                  f"({cpu / w.numel() * 1e9:5.1f} ns/elem)   peak +{extra:.0f} MB RSS", flush=True)
        if args.rotate:
            rows = w[: max(1, (1 << 24) // k)]
            rmb = rows.numel() * 2 / 1e6
            fns = (("rotate", rotate), ("rotate_exact", rotate_exact), ("rotate_dense", rotate_dense))
            for name, fn in fns:
                wall, cpu = _time(lambda: fn(rows, 256), args.repeat)
                print(f"  {name:12s} ({rows.shape[0]} rows): {rmb / wall:7.0f} MB/s  "
                      f"cpu {cpu / rows.numel() * 1e9:5.1f} ns/elem")


if __name__ == "__main__":
    main()
