"""Benchmark the nvfp4 and INT4 ConvRot encoders against comfy-kitchen's eager quantizers at full
MiniMax H3 shapes, side by side, pinned to one core; and the peak memory of a whole-block convert.

Part 1, encoders. Each (shape, format, encoder) run is its own subprocess started under
``taskset -c CORE`` with one torch thread (peak RSS per run, no shared caches). Encoders:
``h3quant`` (``h3quant.formats.<fmt>.tensors``) and ``kitchen`` (comfy-kitchen 0.2.40's layout
``quantize``: ``TensorCoreNVFP4Layout`` / ``TensorCoreConvRotW4A4Layout``, the eager CPU path).
The weight is a seeded bf16 Gaussian (std 0.02) with outlier input columns (1% of columns x
10..40) and a few hot rows (x 4), the same as ``bench_w4a8.py``. Each run prints: encode wall
and CPU seconds (best of ``--repeat``), peak RSS, the stored bytes and bits per weight, the
relative L2 error of the decoded weight, and a SHA-256 of the output bytes; the table shows
whether h3quant's bytes equal kitchen's and the speed ratio (kitchen CPU / h3quant CPU).

Part 2 (``--block DIR``): a full-dims synthetic H3 with one block is written to DIR (``h3quant
synth --preset full --blocks 1``, about 2.4 GB, reused when present) and converted with ``--to``
each target in its own subprocess (default threads); the table shows wall time, peak RSS and
output size next to int8-convrot's and W4A8's (the other whole-layer encoder).

    python bench/bench_fp4.py                          # the four linears of a block, core 1
    python bench/bench_fp4.py --shapes 5376x5376 --repeat 3
    python bench/bench_fp4.py --block /tmp/h3full --no-encoders
Prints numbers; asserts nothing. Each run first encodes 256 rows untimed (imports, caches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# one H3 block's linears: qkv_proj, out_proj, mlp.fc1, mlp.fc2 (plus the square 5376 x 5376)
H3_SHAPES = ["21504x5376", "5376x7168", "28672x5376", "5376x14336"]
FORMATS = ("nvfp4", "int4-convrot")
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


def _encode(fmt: str, encoder: str, w):
    """(tensors, decoded fp32 weight) of one encoder."""
    import torch

    if fmt == "nvfp4":
        if encoder == "kitchen":
            import comfy_kitchen as ck
            from comfy_kitchen.tensor import TensorCoreNVFP4Layout as L

            q, p = L.quantize(w)
            out = {"weight": q, "weight_scale": p.block_scale, "weight_scale_2": p.scale}
            return out, lambda: ck.dequantize_nvfp4(q, p.scale, p.block_scale, torch.float32)
        from h3quant.formats.nvfp4.tensors import decode_nvfp4, encode_nvfp4

        out = encode_nvfp4(w)
        return out, lambda: decode_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"])
    if encoder == "kitchen":
        from comfy_kitchen.tensor import TensorCoreConvRotW4A4Layout as L

        q, p = L.quantize(w, convrot_groupsize=256)
        return {"weight": q, "weight_scale": p.scale}, lambda: L.dequantize(
            q, L.Params(scale=p.scale, orig_dtype=torch.float32, orig_shape=tuple(w.shape)))
    from h3quant.formats.int4_convrot.tensors import decode_int4_convrot, encode_int4_convrot

    q, s = encode_int4_convrot(w, 256)
    return {"weight": q, "weight_scale": s}, lambda: decode_int4_convrot(q, s, 256)


def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    n, k = (int(v) for v in args.worker.split("x"))
    w = make_weight(n, k)
    _encode(args.fmt, args.encoder, w[:256])  # warm-up: imports, caches (not timed)
    best_wall = best_cpu = float("inf")
    for _ in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out, decode = _encode(args.fmt, args.encoder, w)
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    h = hashlib.sha256()
    nbytes = 0
    for name in sorted(out):
        t = out[name].contiguous().reshape(-1)
        raw = t.view(torch.uint8) if t.element_size() == 1 else t
        data = raw.numpy().tobytes()
        h.update(name.encode() + data)
        nbytes += len(data)
    deq = decode().float()
    wf = w.float()
    rel = float((deq[:n, :k] - wf).norm() / wf.norm())
    print(json.dumps({"wall": best_wall, "cpu": best_cpu, "rss": rss, "bytes": nbytes,
                      "bpw": 8 * nbytes / (n * k), "rel": rel, "sha": h.hexdigest()}))


def _run_worker(shape, fmt, encoder, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", shape, "--fmt", fmt, "--encoder", encoder,
           "--repeat", str(args.repeat)]
    if args.core is not None:
        cmd = ["taskset", "-c", str(args.core)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def encoders(args) -> None:
    print(f"encoders, pinned to core {args.core} (one thread), best of {args.repeat}:")
    head = ("shape", "format", "encoder", "wall s", "cpu s", "peak RSS MB", "bytes", "bpw",
            "rel L2", "same bytes", "speed vs kitchen")
    rows = []
    totals: dict = {}
    for shape in args.shapes:
        for fmt in args.formats:
            got = {e: _run_worker(shape, fmt, e, args) for e in ("kitchen", "h3quant")}
            same = (got["kitchen"].get("sha") == got["h3quant"].get("sha")
                    if "sha" in got["kitchen"] and "sha" in got["h3quant"] else None)
            for enc, r in got.items():
                if "error" in r:
                    rows.append((shape, fmt, enc, "error: " + r["error"]) + ("",) * 7)
                    continue
                t = totals.setdefault((fmt, enc), {"cpu": 0.0, "bytes": 0, "w": 0})
                t["cpu"] += r["cpu"]
                t["bytes"] += r["bytes"]
                n, k = (int(v) for v in shape.split("x"))
                t["w"] += n * k
                ratio = (f"{got['kitchen']['cpu'] / r['cpu']:.2f}x"
                         if enc == "h3quant" and "cpu" in got["kitchen"] else "")
                rows.append((shape, fmt, enc, f"{r['wall']:.2f}", f"{r['cpu']:.2f}",
                             f"{r['rss'] / 1e6:.0f}", f"{r['bytes']:,}", f"{r['bpw']:.4f}",
                             f"{r['rel']:.4f}", "" if enc == "kitchen" else str(same), ratio))
            print("  done", shape, fmt, file=sys.stderr)
    _table(head, rows)
    print("\nper format over the shapes above (CPU seconds, stored bytes):")
    for (fmt, enc), t in sorted(totals.items()):
        print(f"  {fmt:13s} {enc:8s} cpu {t['cpu']:7.2f} s   bytes {t['bytes']:,} "
              f"({8 * t['bytes'] / t['w']:.4f} bits per weight)")


def _table(head, rows) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())


def _convert_worker(args) -> None:
    from h3quant.cli import main

    t0 = time.perf_counter()
    try:
        main(["convert", args.src, args.out, "--to", args.to, "-q", "--no-report", "--overwrite"],
             standalone_mode=False)
    except SystemExit:
        pass
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall": wall, "rss": rss, "bytes": os.path.getsize(args.out)}))


def block(args) -> None:
    d = Path(args.block)
    d.mkdir(parents=True, exist_ok=True)
    src = d / "h3_full_1block.safetensors"
    if not src.exists():
        subprocess.run([sys.executable, "-m", "h3quant", "synth", str(src), "--preset", "full",
                        "--blocks", "1"], check=True, cwd=HERE)
    print(f"\nwhole-block convert of {src} ({src.stat().st_size:,} bytes), default threads:")
    rows = []
    for to in ["int8-convrot", "w4a8", *args.formats]:
        out = d / f"out_{to}.safetensors"
        res = subprocess.run([sys.executable, __file__, "--convert", str(src), str(out), to],
                             capture_output=True, text=True, cwd=HERE)
        if res.returncode:
            rows.append((to, "error", res.stderr.strip()[-200:], "", ""))
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append((to, f"{r['wall']:.1f}", f"{r['rss'] / 1e6:.0f}", f"{r['bytes']:,}"))
        out.unlink()
    _table(("--to", "wall s", "peak RSS MB", "output bytes"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=H3_SHAPES, metavar="NxK")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--core", type=int, default=1, help="CPU core to pin each run to")
    ap.add_argument("--block", metavar="DIR", help="also measure a whole-block convert in DIR")
    ap.add_argument("--no-encoders", action="store_true", help="skip part 1")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--fmt", help=argparse.SUPPRESS)
    ap.add_argument("--encoder", help=argparse.SUPPRESS)
    ap.add_argument("--convert", nargs=3, metavar=("SRC", "OUT", "TO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if args.convert:
        args.src, args.out, args.to = args.convert
        return _convert_worker(args)
    if not args.no_encoders:
        encoders(args)
    if args.block:
        block(args)


if __name__ == "__main__":
    main()
