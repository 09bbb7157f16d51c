"""How W4A8 conversion time scales with cores: ``convert --to w4a8`` on 1, 2, ... cores.

    python bench/bench_w4a8_scaling.py --cores 1 2 --repeat 2 [--blocks 1] [--baseline DIR]

Synthesizes (once, cached in --workdir) a full-dimension H3 bf16 checkpoint with ``--blocks``
blocks, then runs ``h3quant convert IN OUT --to w4a8 --workers C --quiet`` pinned to C cores
(``taskset -c 0-(C-1)``, so torch's own threads see C cores too) for every C, alternating,
``--repeat`` rounds, each in its own process (peak RSS and CPU from ``os.wait4``). Prints the
best round of each: wall seconds, user/system CPU seconds, peak RSS, the speedup over the
first C (wall) and the parallel efficiency (speedup per added core). ``--baseline`` adds the
same runs from an old checkout's root. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def synth(path: Path, blocks: int) -> None:
    if path.exists():
        return
    cmd = [sys.executable, "-m", "h3quant", "synth", str(path), "--preset", "full",
           "--blocks", str(blocks), "-q"]
    subprocess.run(cmd, check=True, cwd=HERE, env=dict(os.environ, PYTHONPATH=str(HERE)))


def run(root: Path, src: Path, dst: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "h3quant", "convert", str(src), str(dst), "--to", "w4a8",
           "--workers", str(workers), "--overwrite", "--quiet"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", f"0-{workers - 1}", *cmd]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=root,
                            env=dict(os.environ, PYTHONPATH=str(root)))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise SystemExit(f"convert --workers {workers} ({root}) failed with exit code {code}")
    size = dst.stat().st_size
    dst.unlink()
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime,
            "rss": usage.ru_maxrss * 1024, "out": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", dest="workers", type=int, nargs="+", default=[1, 2],
                    help="core counts to pin to (and --workers for convert)")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="alternating rounds; the best is shown")
    ap.add_argument("--baseline", type=Path, help="root of an old checkout, run side by side")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/h3quant-bench"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / f"full_b{args.blocks}_bf16.safetensors"
    synth(src, args.blocks)
    dst = args.workdir / f"full_b{args.blocks}_w4a8_scaling.safetensors"
    variants = [("after", HERE)] + ([("before", args.baseline.resolve())] if args.baseline else [])
    best: dict[tuple[str, int], dict] = {}
    for rnd in range(args.repeat):
        for name, root in variants:
            order = args.workers if rnd % 2 == 0 else list(reversed(args.workers))
            for w in order:
                r = run(root, src, dst, w)
                print(json.dumps({"round": rnd, "variant": name, "workers": w, **r}),
                      file=sys.stderr, flush=True)
                key = (name, w)
                if key not in best or r["wall"] < best[key]["wall"]:
                    best[key] = r
    in_gb = src.stat().st_size / 1e9
    print(f"\nconvert --to w4a8, {args.blocks} full block(s) ({in_gb:.2f} GB bf16), "
          f"{os.cpu_count()} CPUs, best of {args.repeat} alternating rounds")
    print(f"{'variant':>8} {'cores':>7} {'wall s':>7} {'user s':>7} {'sys s':>6} "
          f"{'peak RSS GB':>11} {'speedup':>7} {'efficiency':>10}")
    for name, _ in variants:
        first = best[(name, args.workers[0])]["wall"]
        for w in args.workers:
            r = best[(name, w)]
            speed = first / r["wall"]
            print(f"{name:>8} {w:>7} {r['wall']:>7.1f} {r['user']:>7.1f} {r['sys']:>6.1f} "
                  f"{r['rss'] / 1e9:>11.2f} {speed:>6.2f}x {speed / (w / args.workers[0]):>10.2f}")


if __name__ == "__main__":
    main()
