"""Benchmark ``h3quant convert``: throughput, peak RSS, and this machine's plain read + write.

    python bench/bench_convert.py --blocks 2 4 [--to int8-convrot] [--workers 1 2] [--no-report]

For each block count: synthesizes (once, cached in --workdir) a full-dimension H3 bf16
checkpoint (``synth --preset full --form pruned``), runs ``h3quant convert`` in a subprocess,
and measures wall time and that subprocess's peak RSS (``os.wait4``). The physical reference is a
plain buffered read of the whole input plus a write (and fsync) of as many bytes as the output,
in the same page-cache state; the ratio says how far the conversion is from pure I/O.
Prints numbers only; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 16 << 20


def synth(path: Path, blocks: int) -> None:
    if path.exists():
        return
    from h3quant.synth import synth_checkpoint

    t = time.perf_counter()
    synth_checkpoint(path, preset="full", blocks=blocks, form="pruned", progress=True)
    print(f"  synthesized {path.name}: {path.stat().st_size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)


def physical(src: Path, out_bytes: int, scratch: Path) -> float:
    """Seconds to read ``src`` and write+fsync ``out_bytes`` bytes (plain file I/O)."""
    buf = bytearray(CHUNK)
    t = time.perf_counter()
    with open(src, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    with open(scratch, "wb", buffering=0) as fh:
        left = out_bytes
        while left > 0:
            left -= fh.write(memoryview(buf)[:min(CHUNK, left)])
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t
    scratch.unlink()
    return dt


def run_convert(src: Path, dst: Path, args, workers: int) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "h3quant", "convert", str(src), str(dst), "--to", args.to,
           "--overwrite", "--quiet", "--json"]
    if workers:
        cmd += ["--workers", str(workers)]
    if args.no_report:
        cmd.append("--no-report")
    if args.no_mmap:
        cmd.append("--no-mmap")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"convert failed with exit code {proc.returncode}")
    return dt, usage.ru_maxrss * 1024, json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--to", default="int8-convrot")
    ap.add_argument("--workers", type=int, nargs="+", default=[0],
                    help="values of --workers to try; 0 = the command's default (one per CPU)")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--no-mmap", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/h3quant-bench"))
    ap.add_argument("--keep-output", action="store_true")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for blocks in args.blocks:
        src = args.workdir / f"full_b{blocks}_bf16.safetensors"
        synth(src, blocks)
        for workers in args.workers:
            dst = args.workdir / f"full_b{blocks}_{args.to}.safetensors"
            dt, rss, rep = run_convert(src, dst, args, workers)
            in_bytes = src.stat().st_size
            out_bytes = dst.stat().st_size
            conv_in = sum(lay_bytes(lay) for lay in rep["layers"] if lay["action"] == "convert")
            ref = physical(src, out_bytes, args.workdir / "physical.tmp")
            rows.append({
                "blocks": blocks, "workers": workers, "target": args.to,
                "input_gb": in_bytes / 1e9, "output_gb": out_bytes / 1e9,
                "converted_gb": conv_in / 1e9, "wall_s": dt, "in_mb_s": in_bytes / 1e6 / dt,
                "converted_mb_s": conv_in / 1e6 / dt, "peak_rss_gb": rss / 1e9,
                "physical_s": ref, "physical_mb_s": in_bytes / 1e6 / ref, "ratio": dt / ref,
                "report": not args.no_report, "mmap": not args.no_mmap,
            })
            print(json.dumps(rows[-1]), flush=True)
            if not args.keep_output:
                dst.unlink()
    print("\nblocks workers  input GB  wall s  input MB/s  conv MB/s  peak RSS GB  "
          "physical s (MB/s)  ratio")
    for r in rows:
        print(f"{r['blocks']:>6} {r['workers']:>7} {r['input_gb']:>9.2f} {r['wall_s']:>7.1f} "
              f"{r['in_mb_s']:>11.0f} {r['converted_mb_s']:>10.0f} {r['peak_rss_gb']:>12.2f} "
              f"{r['physical_s']:>9.1f} ({r['physical_mb_s']:.0f}) {r['ratio']:>6.2f}")


def lay_bytes(lay: dict) -> int:
    n, k = lay["shape"]
    return n * k * 2  # bf16 source


if __name__ == "__main__":
    main()
