"""Benchmark the W4A8 encoder on full MiniMax H3 linear shapes, ours vs comfy-kitchen.

Each (shape, encoder) runs in its own subprocess so peak RSS is per run. The weight is a seeded
bf16 Gaussian (std 0.02) with outlier input columns (1% of columns x 10..40) and a few hot rows
(x 4). Printed per run: encode wall and CPU seconds, throughput in MB/s of bf16 input, peak RSS
during the encode (input included), relative L2 error of decode(encode(W)) against W.

    python bench/bench_w4a8.py                      # all four shapes, ours and kitchen
    python bench/bench_w4a8.py --shapes 5376x7168 --rows 1024 --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

H3_SHAPES = ["21504x5376", "5376x7168", "28672x5376", "5376x14336"]  # qkv, out_proj, fc1, fc2


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def make_weight(n: int, k: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float32).mul_(0.02)
    cols = torch.randperm(k, generator=g)[: max(1, k // 100)]
    w[:, cols] *= torch.empty(cols.numel()).uniform_(10.0, 40.0, generator=g)
    rows = torch.randperm(n, generator=g)[: max(1, n // 1000)]
    w[rows] *= 4.0
    return w.to(torch.bfloat16)


def _worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from h3quant.formats.w4a8 import FROZEN_CODEBOOK, decode_w4a8, encode_w4a8, relative_l2

    n, k = (int(v) for v in args.worker_shape.split("x"))
    w = make_weight(n, k)
    rss_before = _rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    if args.worker_encoder == "ours":
        tensors = encode_w4a8(w, codebook=args.codebook)
    else:
        import comfy_kitchen.tensor  # noqa: F401  (registers the layouts)
        from comfy_kitchen.tensor.base import QuantizedTensor

        qt = QuantizedTensor.from_float(w, "AsymW4A8Int8Layout")
        tensors = {key[len("L."):]: v for key, v in qt.state_dict("L.weight").items()}
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    cb = tensors.get("weight_codebook")
    fitted = cb is not None and not torch.equal(cb.float(), FROZEN_CODEBOOK)
    err = relative_l2(w.float(), decode_w4a8(tensors))
    print(json.dumps({"wall": wall, "cpu": cpu, "peak_rss_mib": peak, "rss_before_mib": rss_before,
                      "rel_l2": err, "fitted": fitted, "input_mib": n * k * 2 / 2**20}))


def _run(shape: str, encoder: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--worker-shape", shape, "--worker-encoder", encoder,
           "--threads", str(args.threads), "--codebook", args.codebook]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {encoder} failed:\n{proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=H3_SHAPES, help="NxK shapes (default: the four H3 block linears)")
    ap.add_argument("--rows", type=int, default=0, help="truncate N to this many rows (quick runs)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--codebook", default="auto", choices=["auto", "frozen", "fit"])
    ap.add_argument("--no-kitchen", action="store_true", help="skip comfy-kitchen")
    ap.add_argument("--worker-shape", help=argparse.SUPPRESS)
    ap.add_argument("--worker-encoder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_shape:
        _worker(args)
        return

    encoders = ["ours"] if args.no_kitchen else ["ours", "kitchen"]
    print(f"{'shape':>12} {'encoder':>8} {'wall s':>8} {'cpu s':>8} {'MB/s':>8} {'peak RSS MiB':>13} "
          f"{'input MiB':>10} {'rel L2':>9} {'fitted':>6}")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        if args.rows:
            n = min(n, args.rows)
        shape = f"{n}x{k}"
        for enc in encoders:
            r = _run(shape, enc, args)
            if r is None:
                continue
            mbps = r["input_mib"] * 2**20 / 1e6 / r["wall"]
            print(f"{shape:>12} {enc:>8} {r['wall']:8.2f} {r['cpu']:8.2f} {mbps:8.1f} {r['peak_rss_mib']:13.0f} "
                  f"{r['input_mib']:10.0f} {r['rel_l2']:9.5f} {str(r['fitted']):>6}", flush=True)


if __name__ == "__main__":
    main()
