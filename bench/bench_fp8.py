"""Benchmark the fp8 encoders (float8_e4m3fn, float8_e5m2, mxfp8) on full MiniMax H3 linear shapes
against comfy-kitchen 0.2.40's eager quantizers, side by side in one run.

Per format and shape: h3quant's encode and kitchen's (``TensorCoreFP8Layout.quantize`` /
``TensorCoreMXFP8Layout.quantize`` on the eager backend) on the same seeded bf16 weight (std 0.02,
1% outlier input columns x 10..40), each timed best of ``--repeat``, one torch thread; the script
re-runs itself under ``taskset -c 1`` (one core) unless ``--no-pin``. Also: whether the bytes are
identical, bits per weight (codes + scales), the bytes of one DiT block's four linears, and the
relative L2 error of the decode against the bf16 weight. ``--convert-block`` also synthesizes a
one-block full-dims checkpoint and reports the peak RSS of ``h3quant convert --to F`` per format
(int8-convrot beside them for comparison). Prints numbers; asserts nothing.

    python bench/bench_fp8.py                      # all formats, the four block linears
    python bench/bench_fp8.py --shapes 5376x5376 --repeat 3
    python bench/bench_fp8.py --convert-block /tmp/h3blk   # + peak RSS of whole-block converts
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

H3_SHAPES = ["21504x5376", "5376x7168", "28672x5376", "5376x14336"]  # qkv, out_proj, fc1, fc2
FORMATS = ["float8_e4m3fn", "float8_e5m2", "mxfp8"]
TARGET = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8-e5m2", "mxfp8": "mxfp8"}


def make_weight(n: int, k: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float32).mul_(0.02)
    cols = torch.randperm(k, generator=g)[: max(1, k // 100)]
    w[:, cols] *= torch.empty(cols.numel()).uniform_(10.0, 40.0, generator=g)
    return w.to(torch.bfloat16)


def _best(fn, repeat: int):
    best, out = None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def _encoders(fmt: str):
    import comfy_kitchen as ck
    import torch
    from comfy_kitchen.tensor.fp8 import TensorCoreFP8Layout
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout

    from h3quant.formats import registry

    codec = registry.get(fmt)

    def mine(w):
        out = codec.encoder.encode(w, {"format": fmt}, None)
        return out["weight"], out["weight_scale"]

    def kitchen(w):
        with ck.registry.use_backend("eager"):
            if fmt == "mxfp8":
                q, p = TensorCoreMXFP8Layout.quantize(w)
            else:
                q, p = TensorCoreFP8Layout.quantize(w, dtype=getattr(torch, fmt))
        return q, p.scale

    def decode(q, s):
        return codec.decoder.decode_weight({"weight": q, "weight_scale": s}, None, torch.float32)

    return mine, kitchen, decode


def run_encoders(shapes: list[str], formats: list[str], repeat: int) -> None:
    import torch

    torch.set_num_threads(1)
    print(f"one torch thread; cpu affinity {sorted(os.sched_getaffinity(0))}; best of {repeat}")
    print(f"{'format':14} {'shape':>11} {'h3quant s':>9} {'kitchen s':>9} {'speedup':>7} "
          f"{'identical':>9} {'bits/w':>7} {'rel L2':>8}")
    block = {f: 0 for f in formats}
    for fmt in formats:
        mine, kitchen, decode = _encoders(fmt)
        for shape in shapes:
            n, k = (int(v) for v in shape.split("x"))
            w = make_weight(n, k)
            t_mine, (q, s) = _best(functools.partial(mine, w), repeat)
            t_kit, (kq, ks) = _best(functools.partial(kitchen, w), repeat)
            same = (torch.equal(q.view(torch.uint8), kq.view(torch.uint8))
                    and torch.equal(s.reshape(-1).view(torch.uint8), ks.reshape(-1).view(torch.uint8)))
            nbytes = q.numel() * q.element_size() + s.numel() * s.element_size()
            block[fmt] += nbytes
            wf = w.float()
            rel = float((decode(q, s) - wf).norm() / wf.norm())
            print(f"{fmt:14} {shape:>11} {t_mine:9.3f} {t_kit:9.3f} {t_kit / t_mine:7.2f}x "
                  f"{'yes' if same else 'NO':>9} {8 * nbytes / (n * k):7.3f} {rel:8.5f}", flush=True)
            del w, wf, q, s, kq, ks
    if set(shapes) == set(H3_SHAPES):
        params = sum(int(a) * int(b) for a, b in (s.split("x") for s in H3_SHAPES))
        print("\none DiT block's four linears (qkv, out_proj, fc1, fc2): "
              f"{params:,} weights, bf16 {2 * params / 1e6:.1f} MB")
        for fmt in formats:
            print(f"  {fmt:14} {block[fmt] / 1e6:8.1f} MB")


def convert_block(where: Path, formats: list[str]) -> None:
    """Peak RSS of whole-block converts of a full-dims one-block synthetic checkpoint."""
    where.mkdir(parents=True, exist_ok=True)
    src = where / "blk_bf16.safetensors"
    exe = [sys.executable, "-m", "h3quant"]
    if not src.exists():
        subprocess.run(exe + ["synth", str(src), "--preset", "full", "--blocks", "1"], check=True)
    print(f"\nwhole-block convert of {src} ({src.stat().st_size / 1e9:.2f} GB), peak RSS:")
    for target in [TARGET[f] for f in formats] + ["int8-convrot"]:
        out = where / f"blk_{target}.safetensors"
        if out.exists():
            out.unlink()
        code = ("import resource, subprocess, sys, time; t0 = time.perf_counter(); "
                "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                "dt = time.perf_counter() - t0; "
                "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, dt); "
                "sys.stderr.write(r.stderr[-400:] if r.returncode else '')")
        r = subprocess.run([sys.executable, "-c", code, *exe, "convert", str(src), str(out),
                            "--to", target, "--no-report"], capture_output=True, text=True)
        rc, rss_kb, dt = r.stdout.split()
        print(f"  --to {target:13} exit {rc}  peak RSS {int(rss_kb) / 1024:8.1f} MiB  "
              f"{float(dt):6.1f} s  {out.stat().st_size / 1e9 if out.exists() else 0:.3f} GB"
              + (f"  {r.stderr.strip()}" if rc != "0" else ""), flush=True)
        if out.exists():
            out.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(H3_SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-pin", action="store_true", help="do not re-run under taskset -c 1")
    ap.add_argument("--convert-block", type=Path, default=None, metavar="DIR",
                    help="also measure whole-block converts (writes a ~2.4 GB file in DIR)")
    args = ap.parse_args()
    if not args.no_pin and shutil.which("taskset") and os.environ.get("BENCH_FP8_PINNED") != "1":
        env = dict(os.environ, BENCH_FP8_PINNED="1")
        sys.exit(subprocess.run(["taskset", "-c", "1", sys.executable, *sys.argv], env=env).returncode)
    formats = args.formats.split(",")
    run_encoders(args.shapes.split(","), formats, args.repeat)
    if args.convert_block is not None:
        convert_block(args.convert_block, formats)
    print(f"\npeak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
