"""Benchmark the W4A8 encoder on full MiniMax H3 linear shapes: before/after side by side.

Each (shape, encoder) run is its own subprocess (peak RSS per run, no shared caches). Encoders:
``after`` (this checkout), ``before`` (the h3quant of ``--baseline``, an old checkout's root),
``kitchen`` (comfy-kitchen's ``AsymW4A8Int8Layout``). The weight is a seeded bf16 Gaussian
(std 0.02) with outlier input columns (1% of columns x 10..40) and a few hot rows (x 4).
An h3quant encoder runs as ``convert`` runs it: where its tree has ``h3quant.alloc`` (the glibc
malloc thresholds ``convert`` sets), that is applied first (column ``alloc``). ``--warm``
encodes the first eighth of the rows once before the measured run, as in the second and later
layers of a whole-model conversion. Encoders run alternately, ``--repeat`` rounds; the best
round of each is printed: encode wall, CPU (user + system) and system seconds, ns per weight
(CPU), MB/s of bf16 input (wall), peak RSS, relative L2 error of decode(encode(W)) against W,
and the before/after speed ratio (CPU). Prints numbers; asserts nothing.

    python bench/bench_w4a8.py --baseline /tmp/h3base --threads 1 --rows 2048
    python bench/bench_w4a8.py --shapes 5376x7168 --threads 1 --repeat 3 --warm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

H3_SHAPES = ["21504x5376", "5376x7168", "28672x5376", "5376x14336"]  # qkv, out_proj, fc1, fc2
HERE = Path(__file__).resolve().parent.parent


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
    from h3quant.formats.w4a8.tensors import (
        FROZEN_CODEBOOK,
        decode_w4a8,
        encode_w4a8,
        relative_l2,
    )

    n, k = (int(v) for v in args.worker_shape.split("x"))
    w = make_weight(n, k)
    alloc = False
    if args.worker_encoder in ("before", "after"):
        try:  # what ``convert`` does before it encodes (absent from older trees)
            from h3quant.alloc import keep_freed_memory
        except ImportError:
            pass
        else:
            alloc = keep_freed_memory()

        def encode(x):
            return encode_w4a8(x, codebook=args.codebook)
    else:
        import comfy_kitchen.tensor  # noqa: F401  (registers the layouts)
        from comfy_kitchen.tensor.base import QuantizedTensor

        def encode(x):
            qt = QuantizedTensor.from_float(x, "AsymW4A8Int8Layout")
            return {key[len("L."):]: v for key, v in qt.state_dict("L.weight").items()}
    if args.warm:
        encode(w[: max(1, n // 8)])
    t0, c0 = time.perf_counter(), os.times()
    tensors = encode(w)
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu, sys_s = (c1.user - c0.user) + (c1.system - c0.system), c1.system - c0.system
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    cb = tensors.get("weight_codebook")
    fitted = cb is not None and not torch.equal(cb.float(), FROZEN_CODEBOOK)
    err = relative_l2(w.float(), decode_w4a8(tensors))
    print(json.dumps({"wall": wall, "cpu": cpu, "sys": sys_s, "alloc": alloc, "peak_rss_mib": peak, "rel_l2": err,
                      "fitted": fitted, "weights": n * k, "root": str(Path(
                          sys.modules["h3quant"].__file__).resolve().parent.parent)}))


def _run(shape: str, encoder: str, args) -> dict | None:
    root = args.baseline if encoder == "before" else HERE
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-shape", shape,
           "--worker-encoder", encoder, "--threads", str(args.threads), "--codebook", args.codebook]
    if args.warm:
        cmd.append("--warm")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        print(f"  {encoder} failed:\n{proc.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if encoder != "kitchen" and Path(r["root"]) != Path(root).resolve():
        raise SystemExit(f"{encoder}: imported h3quant from {r['root']}, expected {root}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=H3_SHAPES, help="NxK shapes (default: the four H3 block linears)")
    ap.add_argument("--rows", type=int, default=0, help="truncate N to this many rows (quick runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--codebook", default="auto", choices=["auto", "frozen", "fit"])
    ap.add_argument("--baseline", type=Path, help="root of an old checkout: adds the 'before' encoder")
    ap.add_argument("--repeat", type=int, default=1, help="alternating rounds; the best is shown")
    ap.add_argument("--no-kitchen", action="store_true", help="skip comfy-kitchen")
    ap.add_argument("--warm", action="store_true", help="encode an eighth of the rows once first (steady state)")
    ap.add_argument("--worker-shape", help=argparse.SUPPRESS)
    ap.add_argument("--worker-encoder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_shape:
        _worker(args)
        return

    encoders = (["before"] if args.baseline else []) + ["after"] + ([] if args.no_kitchen else ["kitchen"])
    print(f"threads={args.threads} repeat={args.repeat} codebook={args.codebook} warm={args.warm}")
    print(f"{'shape':>12} {'encoder':>8} {'alloc':>5} {'wall s':>8} {'cpu s':>8} {'sys s':>7} "
          f"{'ns/weight':>10} {'MB/s':>8} "
          f"{'peak RSS MiB':>13} {'rel L2':>10} {'fitted':>6} {'speedup':>8}")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        if args.rows:
            n = min(n, args.rows)
        shape = f"{n}x{k}"
        best: dict[str, dict] = {}
        for _ in range(args.repeat):
            for enc in encoders:
                r = _run(shape, enc, args)
                if r is not None and (enc not in best or r["cpu"] < best[enc]["cpu"]):
                    best[enc] = r
        for enc in encoders:
            r = best.get(enc)
            if r is None:
                continue
            mbps = r["weights"] * 2 / 1e6 / r["wall"]
            ratio = (f"{best['before']['cpu'] / r['cpu']:7.2f}x" if "before" in best and enc == "after"
                     else "")
            print(f"{shape:>12} {enc:>8} {r.get('alloc', False)!s:>5} {r['wall']:8.2f} {r['cpu']:8.2f} "
                  f"{r.get('sys', 0.0):7.2f} "
                  f"{r['cpu'] / r['weights'] * 1e9:10.1f} {mbps:8.1f} {r['peak_rss_mib']:13.0f} "
                  f"{r['rel_l2']:10.6f} {r['fitted']!s:>6} {ratio:>8}", flush=True)


if __name__ == "__main__":
    main()
