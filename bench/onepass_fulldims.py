"""One-pass calibrated convert at H3's full dimensions on this machine: peak memory and disk, time
per block and phase, the GEMM floor of each phase, and the extrapolation to 50 blocks. Prints
numbers; synthetic checkpoint (random weights: times and sizes, not quality).

    nice python bench/onepass_fulldims.py [--dir /tmp/h3full] [--to int8-convrot] [--calls 8]
        [--blocks 2] [--frames 1] [--latent 60x104] [--text 128] [--audio 56]

1. a child process writes ``h3quant synth --preset full --blocks N`` (hidden 5376, attention
   7168, ffn 14336) and ``--calls`` inputs files: ``--frames`` latent frames of ``--latent``
   (H x W; 60 x 104 is an 832 x 480 frame at 8x spatial compression: 30 x 52 = 1,560 video rows
   per latent frame in 2 x 2 patches), ``--text`` text tokens, ``--audio`` audio frames (2 rows
   each). The defaults make 8 x 1,800 = 14,400 rows, just over fc2's K = 14,336: every
   layer's H is full rank, so every layer is factorised (fewer rows round layers to nearest);
2. this process measures ``torch.mm`` throughput (float32, [2048, 5376] x [5376, 5376], the
   best of 5) and runs ``convert --calibrate-on`` on the inputs (float feedback, default
   memory budget), a thread sampling the work folder's size every 0.2 s;
3. prints per block and phase the time, the phase's FLOPs (model below), its floor (FLOPs /
   the measured throughput), the process's peak RSS and the work folder's peak; then 50 blocks
   extrapolated from the mean block time on these CPUs, and by FLOP count on one H100.

FLOP model (multiply-add = 2): capture, per call of S rows and per linear [N, K]: forward
2 S N K, statistics ``H += x^T x`` 2 S K^2; attention 4 S^2 x 7168 (scores and values).
Factorisation per linear: error feedback 2 N K^2 plus K^3 (Cholesky and inverse of H).
Feedback (float): none (the capture's outputs move on). Write: disk only.
H100 assumption: 67 TFLOP/s float32 (non-tensor) and 495 TFLOP/s TF32 tensor-core dense
(NVIDIA H100 SXM5 datasheet); the capture's float32 GEMMs at either rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

H100_FP32 = 67e12
H100_TF32 = 495e12

_PREPARE = r"""
import sys, torch
from pathlib import Path
from h3quant.calibration.recorder import write_inputs
from h3quant.runtime.model.model import H3Model
from h3quant.synth import synth_checkpoint

d, calls, frames, h, w, text, audio, blocks = Path(sys.argv[1]), *map(int, sys.argv[2:9])
src = d / f"float_{blocks}.safetensors"
if not src.exists():
    synth_checkpoint(src, preset="full", blocks=blocks, seed=0)
(d / "A").mkdir(exist_ok=True)
with H3Model.open(src) as m:
    for s in range(calls):
        g = torch.Generator().manual_seed(s)
        write_inputs(d / "A" / f"in{s}.safetensors",
                     torch.randn(1, m.video_channels, frames, h, w, generator=g),
                     torch.randn(1, m.audio_channels, 2, audio, generator=g),
                     torch.randn(1, text, m.text_dim, generator=g),
                     0.15 + 0.8 * ((s * 0.37) % 1.0), {"seed": str(s)})
"""


def mm_throughput() -> float:
    import torch

    a, b = torch.randn(2048, 5376), torch.randn(5376, 5376)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 * 5376 * 5376 / best


class FolderPeak(threading.Thread):
    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.peak, self.stop = folder, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                n = sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())
            except OSError:
                n = 0
            self.peak = max(self.peak, n)
            self.stop.wait(0.2)


def phase_flops(shapes: dict[str, tuple[int, int]], rows: list[int], attn: int) -> dict:
    cap = sum(2 * s * n * k + 2 * s * k * k for s in rows for n, k in shapes.values())
    cap += sum(4 * s * s * attn for s in rows)
    fac = sum(2 * n * k * k + k ** 3 for n, k in shapes.values())
    return {"capture": cap, "factorisation": fac, "feedback": 0, "write": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h3full"))
    ap.add_argument("--to", default="int8-convrot")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--frames", type=int, default=1)
    ap.add_argument("--latent", default="60x104")
    ap.add_argument("--text", type=int, default=128)
    ap.add_argument("--audio", type=int, default=56)
    args = ap.parse_args()
    h, w = map(int, args.latent.split("x"))
    d = args.dir
    d.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _PREPARE, str(d), str(args.calls), str(args.frames),
                    str(h), str(w), str(args.text), str(args.audio), str(args.blocks)],
                   check=True)
    print(f"prepare (synth full, {args.blocks} block(s) + {args.calls} inputs, child process): "
          f"{time.perf_counter() - t:.0f} s")

    import torch

    from h3quant.limits import model_rows
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.pipelines.convert.onepass import work_dir
    from h3quant.runtime.model.model import H3Model
    from h3quant.sizes import size_text

    src = d / f"float_{args.blocks}.safetensors"
    with H3Model.open(src) as m:
        hidden = m.hidden
    from h3quant.h3.topology import config_for

    cfg = config_for("full", blocks=args.blocks)
    shapes = {sub: cfg.linear_shape(sub) for sub in
              ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    rows_one = model_rows(args.frames, h, w, args.audio, args.text)
    rows = [rows_one] * args.calls
    flops = phase_flops(shapes, rows, cfg.attn_width)
    rate = mm_throughput()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"torch.mm float32 [2048, 5376] x [5376, 5376]: {rate / 1e9:.1f} GFLOP/s")
    print(f"inputs: {args.calls} calls x {rows_one:,} rows (text {args.text}, audio "
          f"2 x {args.audio}, video {args.frames} x {-(-h // 2)} x {-(-w // 2)}); hidden "
          f"{hidden}; linears [N, K]: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))
    out = d / f"out_{args.to}.safetensors"
    shutil.rmtree(work_dir(out), ignore_errors=True)  # an earlier bench run's, killed
    peak = FolderPeak(work_dir(out))
    peak.start()
    t, cpu = time.perf_counter(), time.process_time()
    rep = convert(src, out, ConvertOptions(target=args.to, calibrate_on=(str(d / "A"),),
                                           overwrite=True, report=False),
                  log=lambda msg: print("  " + msg, flush=True))
    total, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak.stop.set()
    peak.join()
    one = rep.extra["onepass"]
    load1 = os.getloadavg()
    print(f"\none pass {args.to}: {total:.0f} s in all, {cpu:.0f} s of CPU time (this process, "
          f"all threads; assemble {one['assemble_s']:.0f} s); "
          f"work folder peak {size_text(peak.peak)}; peak RSS "
          f"{size_text(max(b['peak_rss_bytes'] for b in one['blocks']))}; load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after (2 CPUs shared)")
    print("\n| block | phase | time s | GFLOP | floor s (GFLOP / torch.mm rate) | time / floor |")
    print("|---:|---|---:|---:|---:|---:|")
    for b in one["blocks"]:
        for p in ("capture", "factorisation", "feedback", "write"):
            f = flops[p]
            floor = f / rate
            ratio = f"{b[p] / floor:.1f}" if floor else "-"
            print(f"| {b['block']} | {p} | {b[p]:.1f} | {f / 1e9:,.0f} | {floor:.1f} | {ratio} |")
    mean = sum(b["total"] for b in one["blocks"]) / len(one["blocks"])
    per_block = flops["capture"] + flops["factorisation"]
    print(f"\n50 blocks on these CPUs: {50 * mean / 3600:.2f} h ({mean:.0f} s per block, the "
          f"mean of {len(one['blocks'])}; plus the output's assembly)")
    print(f"50 blocks by FLOP count ({per_block / 1e12:.1f} TFLOP per block): one H100 at "
          f"{H100_FP32 / 1e12:.0f} TFLOP/s float32: {50 * per_block / H100_FP32:.0f} s; at "
          f"{H100_TF32 / 1e12:.0f} TFLOP/s TF32: {50 * per_block / H100_TF32:.0f} s (GEMM floor, "
          "no I/O)")
    print(json.dumps({"flops": flops, "mm_flops_per_s": rate, "blocks": one["blocks"],
                      "wall_s": total, "cpu_s": cpu, "load": [load0, load1],
                      "work_peak_bytes": peak.peak, "rows_per_call": rows_one,
                      "calls": args.calls}))


if __name__ == "__main__":
    main()
