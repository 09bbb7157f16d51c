"""Benchmark the per-block ``verify`` against an earlier revision, side by side.

    python bench/bench_verify.py CKPT [--reference BF16] [--blocks 1] [--before REV] [--runs 2]

Exports the ``h3quant`` package of git revision REV (default: the commit before the verify
speed-up) to a temporary directory, then alternates runs of ``python -m h3quant verify CKPT
--blocks N`` from that revision and from this working tree, each in a fresh subprocess (wall time
and peak RSS from ``os.wait4``), so both see the same machine load and page-cache state.
Prints numbers only; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(src: Path, args) -> tuple[float, int, int]:
    cmd = [sys.executable, "-m", "h3quant", "verify", str(args.ckpt), "--blocks",
           str(args.blocks)] + (["--reference", str(args.reference)] if args.reference else [])
    env = dict(os.environ, PYTHONPATH=str(src))
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--reference", type=Path)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--before", required=True, help="git revision to compare with (e.g. a release tag)")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="h3quant-bench-verify-") as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "h3quant"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        results: dict[str, list] = {"before": [], "after": []}
        for _ in range(args.runs):
            for name, src in (("before", old), ("after", ROOT)):
                results[name].append(run(src, args))
        ref = f" --reference {args.reference.name}" if args.reference else ""
        print(f"verify {args.ckpt.name}{ref} --blocks {args.blocks}, {args.runs} alternating runs")
        for name, rows in results.items():
            times = ", ".join(f"{t:.1f}" for t, _, _ in rows)
            rss = max(r for _, r, _ in rows) / 1e9
            codes = sorted({c for _, _, c in rows})
            print(f"  {name:<6s} ({args.before if name == 'before' else 'this tree'}): {times} s, "
                  f"peak RSS {rss:.2f} GB, exit {codes}")
        b = min(t for t, _, _ in results["before"])
        a = min(t for t, _, _ in results["after"])
        print(f"  best-of ratio after/before: {a / b:.2f}")


if __name__ == "__main__":
    main()
