#!/usr/bin/env bash
# Calibration on a CUDA machine: the per-block bench at full dims on the GPU and on its CPUs,
# and capture --device cuda against capture on the CPU (tiny synthetic checkpoint).
# Usage: bash bench/device_calib.sh   (from the repository root; results also under $OUT)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_calib}; mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 150 python3 bench/bench_calib.py --dims full --rows 8192 --device cuda --repeat 2 2>&1 | tee "$OUT/bench_cuda.txt"
timeout 200 python3 bench/bench_calib.py --dims full --rows 8192 --device cpu --repeat 1 2>&1 | tee "$OUT/bench_cpu16.txt"
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/capture_cuda.txt"
import time, torch
from pathlib import Path
from h3quant.synth import synth_checkpoint
from h3quant.calibration.recorder import write_inputs
from h3quant.calibration.stats import Statistics
from h3quant.pipelines.capture import capture_statistics
from h3quant.runtime.model.model import H3Model
d = Path("/tmp/cc"); d.mkdir(exist_ok=True)
src = d / "m.safetensors"; synth_checkpoint(src, preset="tiny", blocks=4, seed=0)
with H3Model.open(src) as m:
    ins = []
    for s in range(6):
        g = torch.Generator().manual_seed(s); p = d / f"i{s}.safetensors"
        write_inputs(p, torch.randn(1, m.video_channels, 2, 16, 16, generator=g),
                     torch.randn(1, m.audio_channels, 2, 32, generator=g),
                     torch.randn(1, 64, m.text_dim, generator=g), 0.3 + 0.1 * s)
        ins.append(p)
for dev in ("cpu", "cuda"):
    t0 = time.perf_counter()
    capture_statistics(src, ins, d / f"{dev}.stats", device=dev, overwrite=True, predict=False)
    print(dev, "capture", round(time.perf_counter() - t0, 2), "s")
with Statistics(d / "cpu.stats") as a, Statistics(d / "cuda.stats") as b:
    worst = max(float((a.layers[k].hessian() - b.layers[k].hessian()).norm()
                      / a.layers[k].hessian().norm()) for k in a.layers)
    print("capture cuda vs cpu: worst relative difference of H over", len(a.layers), "layers:", worst)
PY
