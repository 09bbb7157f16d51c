"""Benchmark the whole-model forward: time per block and peak RSS, flat in the block count.

    python bench/bench_model.py --blocks 2 4 [--backends torch-int8 dequant] [--workdir DIR]

For each block count: synthesizes (once, cached in --workdir) a full-dimension H3 bf16 file and
its int8-convrot conversion, then in fresh subprocesses (peak RSS from ``os.wait4``):
- ``verify CKPT --reference BF16 --model`` with its default inputs: wall time and peak RSS;
- ``H3Model`` forward of the int8 file on the CPU with each runtime backend (``torch-int8``:
  ``_int_mm``; ``dequant``: weights dequantized on the device, plain matmul): seconds per block
  and peak RSS.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's h3quant, also in the child processes


def make_files(workdir: Path, blocks: int) -> tuple[Path, Path]:
    bf16, int8 = workdir / f"full{blocks}.safetensors", workdir / f"full{blocks}_int8.safetensors"
    h3q = [sys.executable, "-m", "h3quant"]
    if not bf16.exists():
        subprocess.run(h3q + ["synth", str(bf16), "--preset", "full", "--blocks", str(blocks)],
                       check=True)
    if not int8.exists():
        subprocess.run(h3q + ["convert", str(bf16), str(int8), "--to", "int8-convrot"],
                       check=True)
    return bf16, int8


def measured(cmd: list[str]) -> tuple[float, int, bytes]:
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"{cmd[3:5]} failed with status {status}")
    return time.perf_counter() - t, usage.ru_maxrss * 1024, out


def child_forward(path: str, backend: str) -> None:
    """In a subprocess: one forward with the verify defaults; prints per-block seconds."""
    import torch

    from h3quant.pipelines.verify.model import ModelInputs
    from h3quant.runtime.model import H3Model

    inp = ModelInputs()
    stamps = []
    with H3Model.open(path, "cpu", backend=backend) as m:
        v, a, t = inp.tensors(m.video_channels, m.audio_channels, m.text_dim)
        t0 = time.perf_counter()
        state = m.start(v, a, t, inp.sigma)
        stamps.append(time.perf_counter())
        for i in m.blocks:
            m.run_block(state, i)
            stamps.append(time.perf_counter())
        m.finish(state)
        torch.cpu.synchronize()
    per_block = [b - a for a, b in zip(stamps, stamps[1:])]
    print(json.dumps({"start_s": stamps[0] - t0, "per_block_s": per_block,
                      "rows": state.x.shape[0]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--backends", nargs="*", default=["torch-int8", "dequant"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/h3quant-bench-model"))
    ap.add_argument("--no-verify", action="store_true", help="skip the verify --model runs")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_forward(*args.child)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    for blocks in args.blocks:
        bf16, int8 = make_files(args.workdir, blocks)
        print(f"full dims, {blocks} blocks ({int8.stat().st_size / 1e9:.2f} GB int8, "
              f"{bf16.stat().st_size / 1e9:.2f} GB bf16)")
        if not args.no_verify:
            dt, rss, out = measured([sys.executable, "-m", "h3quant", "verify", str(int8),
                                     "--reference", str(bf16), "--model", "--json"])
            doc = json.loads(out)
            outs = ", ".join(f"{o['name']} {o['sqnr_db']:.1f} dB" for o in doc["outputs"])
            print(f"  verify --model --reference: {dt:6.1f} s  peak RSS {rss / 1e9:.2f} GB  "
                  f"({outs})")
        for backend in args.backends:
            dt, rss, out = measured([sys.executable, __file__, "--child", str(int8), backend])
            doc = json.loads(out)
            pb = doc["per_block_s"]
            print(f"  forward {backend:<10s} {doc['rows']} rows: embed+refiner "
                  f"{doc['start_s']:.1f} s, per block {min(pb):.1f}-{max(pb):.1f} s, "
                  f"total {dt:.1f} s, peak RSS {rss / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
