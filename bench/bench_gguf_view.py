"""Benchmark ``h3quant convert`` from a GGUF file: time, peak RSS and temporary bytes on disk.

    python bench/bench_gguf_view.py [--preset tiny] [--blocks 16] [--qtype Q8_0] [--repeat 3]
                                    [--to int8-convrot] [--baseline /tmp/h3base]

Synthesizes (once, in --workdir) a BF16 H3 checkpoint (``synth``, random weights) and a GGUF
file of it written with the gguf package (the DiT block linears in ``--qtype`` by the package's
own quantizer, the rest F32). Then, ``--repeat`` rounds: ``h3quant convert GGUF OUT --to ...``
of this checkout (and of ``--baseline``, an older tree's root, when given) in a subprocess with
its own TMPDIR, reporting

- ``time``: wall seconds of the command;
- ``peak RSS``: from ``os.wait4`` (the child's maximum resident set);
- ``temp bytes``: the most bytes seen at once (polled every 5 ms) in TMPDIR and in OUT's
  folder beyond OUT's own size (the staged output counts as OUT): a float copy of the GGUF
  file shows here.

The fastest time, the lowest peak RSS and the most temporary bytes over the rounds are
printed. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from child import run_h3quant

HERE = Path(__file__).resolve().parent.parent


def make_inputs(work: Path, preset: str, blocks: int, qtype: str) -> Path:
    sys.path.insert(0, str(HERE / "tests"))
    from helpers.gguf_files import write_gguf
    from helpers.h3files import read_tensors

    from h3quant.synth import synth_checkpoint

    src = work / f"h3-{preset}-{blocks}.safetensors"
    dst = work / f"h3-{preset}-{blocks}-{qtype}.gguf"
    if not dst.exists():
        t = time.perf_counter()
        if not src.exists():
            synth_checkpoint(src, preset=preset, blocks=blocks, seed=0)
        tensors, _ = read_tensors(src)
        write_gguf(tensors, dst, qtype)
        print(f"  wrote {dst.name}: {dst.stat().st_size / 1e6:.1f} MB in "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    return dst


def _bytes_under(folder: Path) -> int:
    n = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                n += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return n


def run_once(tree: Path, gguf: Path, work: Path, target: str) -> dict:
    tmp, outdir = work / "tmpdir", work / "out"
    for d in (tmp, outdir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    out = outdir / "out.safetensors"
    peak = [0]
    done = threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], _bytes_under(tmp) + _bytes_under(outdir))
            time.sleep(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        child = run_h3quant(tree, ["convert", gguf, out, "--to", target, "-q", "--no-report"],
                            cwd=work, env={"TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1"})
    finally:
        done.set()
        watcher.join()
    out_bytes = out.stat().st_size
    result = {"time_s": child.seconds, "rss_mb": child.peak_rss_mib,
              "temp_mb": max(0, peak[0] - out_bytes) / 1e6, "out_mb": out_bytes / 1e6}
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(outdir, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--qtype", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K"])
    ap.add_argument("--to", default="int8-convrot")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/h3quant-bench-gguf")
    ap.add_argument("--baseline", help="an older h3quant tree's root, run the same way")
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.make_only:
        make_inputs(work, args.preset, args.blocks, args.qtype)
        return
    # the inputs are made in a child process: a child forked from a process holding the
    # tensors would count them in its own peak RSS
    subprocess.run([sys.executable, __file__, "--make-only", "--preset", args.preset,
                    "--blocks", str(args.blocks), "--qtype", args.qtype, "--workdir",
                    str(work)], check=True)
    gguf = work / f"h3-{args.preset}-{args.blocks}-{args.qtype}.gguf"
    trees = {"this": HERE}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    print(f"convert {gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB) --to {args.to}; "
          f"best of {args.repeat}")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            runs[name].append(run_once(tree, gguf, work, args.to))
    for name, rs in runs.items():  # fastest time, lowest RSS, most temporary bytes seen
        print(f"{name:9s} time {min(r['time_s'] for r in rs):6.2f} s  peak RSS "
              f"{min(r['rss_mb'] for r in rs):7.1f} MB  temp bytes "
              f"{max(r['temp_mb'] for r in rs):7.1f} MB  output {rs[0]['out_mb']:.1f} MB")


if __name__ == "__main__":
    main()
