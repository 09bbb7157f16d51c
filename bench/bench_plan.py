"""The planner end to end on synthetic H3 files: the sensitivity pass's time per block and peak
RSS, and the frontier (all-bf16, all-int8-convrot, all-W4A8 and planner files at targets between
the uniform ones), each point predicted and then measured (converted and run by verify --model
against the float file on the same inputs). Prints one line per point and a verdict: the planner
file is smaller than all-int8 and meets its target when verified.

usage: python bench/bench_plan.py [--preset tiny|full] [--blocks N] [--targets DB,..] [--dir D]
  python bench/bench_plan.py --preset tiny --blocks 16          # ~1 min
  python bench/bench_plan.py --preset full --blocks 2           # ~20 min on 2 cores, ~9 GB disk
Synthetic weights (seeded Gaussians): a real H3's sensitivities differ; the figures show how far
the additive prediction is from the measurement, and what the pass costs.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--targets", default=None, help="planner targets in dB (default: 3 between)")
    ap.add_argument("--margin", type=float, default=1.0)
    ap.add_argument("--per-layer", action="store_true", help="plan each linear (finer steps)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    blocks = args.blocks or (16 if args.preset == "tiny" else 2)

    from h3quant.pipelines.plan.frontier import default_targets, frontier
    from h3quant.pipelines.plan.planner import Model
    from h3quant.pipelines.plan.sensitivity import measure

    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="h3quant-bench-plan-", dir=args.dir) as d:
        src = Path(d) / "bf16.safetensors"
        # the synthetic file is written by a child process: the RSS below is the planner's own
        subprocess.run([sys.executable, "-m", "h3quant", "synth", str(src), "--preset",
                        args.preset, "--blocks", str(blocks), "--seed", "7", "-q"], check=True)
        print(f"input: synthetic H3 {args.preset}, {blocks} blocks"
              f"{' (per linear)' if args.per_layer else ''}, "
              f"{src.stat().st_size / 1e6:.1f} MB bf16")
        t0 = time.perf_counter()
        sens = measure(src, per_layer=args.per_layer)
        wall = time.perf_counter() - t0
        per = sens.seconds_per_block
        print(f"sensitivity pass: {wall:.1f} s wall, {len(sens.units)} measurements, "
              f"{sum(per) / len(per):.2f} s per block (min {min(per):.2f}, max {max(per):.2f}), "
              f"peak RSS {_rss_mb():.0f} MB")
        model = Model(sens, src.stat().st_size)
        targets = ([float(t) for t in args.targets.split(",")] if args.targets
                   else default_targets(model))
        t0 = time.perf_counter()
        points = frontier(src, model, targets, margin=args.margin, workdir=d)
        print(f"frontier: {len(points)} points converted and verified in "
              f"{time.perf_counter() - t0:.1f} s; peak RSS {_rss_mb():.0f} MB")
        print(f"{'file':<16} {'MB pred':>9} {'MB meas':>9} {'dB pred':>8} {'dB meas':>8} "
              f"{'error':>6}  formats")
        for p in points:
            pm, mm = p.predicted_min, p.measured_min
            err = f"{mm - pm:+.2f}" if mm is not None and mm != float("inf") else "-"
            counts = ", ".join(f"{n} {f}" for f, n in sorted(p.formats.items()))
            print(f"{p.name:<16} {p.predicted_bytes / 1e6:>9.2f} "
                  f"{(p.measured_bytes or 0) / 1e6:>9.2f} {pm:>8.2f} {mm:>8.2f} {err:>6}  "
                  f"{counts}")
        by = {p.name: p for p in points}
        int8 = by.get("all-int8-convrot")
        # each planner file meets its target and is no larger than all-int8; at least one
        # (a target inside the gap the units' granularity allows) is strictly smaller
        ok, any_smaller = True, False
        for p in points:
            if p.target_sqnr is None:
                continue
            meets = p.measured_min is not None and p.measured_min >= p.target_sqnr
            smaller = int8 is not None and p.measured_bytes < int8.measured_bytes
            any_smaller |= meets and smaller
            ok &= meets and int8 is not None and p.measured_bytes <= int8.measured_bytes
            print(f"{p.name}: measured {p.measured_min:.2f} dB "
                  f"({'meets' if meets else 'MISSES'} the target), "
                  f"{p.measured_bytes / 1e6:.2f} MB "
                  f"({'smaller' if smaller else 'NOT smaller'} than all-int8 "
                  f"{int8.measured_bytes / 1e6 if int8 else float('nan'):.2f} MB)")
        ok &= any_smaller
        print("verdict:", "PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
