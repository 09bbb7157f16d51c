"""Whole-model SQNR per target format: ``verify --model`` of one bf16 checkpoint converted to each
target, against that checkpoint, on the CPU (default inputs), one after another in one run.

    python bench/bench_model_formats.py IN.safetensors [--targets int8-convrot fp8 ...]

``IN``: e.g. ``h3quant synth IN --preset full --blocks 1`` (the real H3 widths, synthetic
weights). Prints, per target: the output SQNR of video and audio, the last hidden state's, the
backends that ran the layers (the runtime's default CPU path: INT4 ConvRot ``emulated`` with
int4 activations, int8 and W4A8 ``torch-int8`` with int8 activations, the float formats
``dequant``), the verdict and the seconds taken. Asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.model import verify_model
from h3quant.runtime.paths import path_for

TARGETS = ("int8-convrot", "w4a8", "fp8", "fp8-e5m2", "mxfp8", "nvfp4", "int4-convrot")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    a = ap.parse_args()
    print(f"verify --model of {a.src.name} converted to each target, reference: the file itself "
          "(CPU, default inputs)")
    print(f"{'target':<13} {'video dB':>9} {'audio dB':>9} {'hidden dB':>10}  {'verdict':<7} "
          f"{'s':>6}  backends")
    with tempfile.TemporaryDirectory(dir=a.src.parent) as d:
        for target in a.targets:
            out = Path(d) / f"{target}.safetensors"
            convert(a.src, out, ConvertOptions(target=target, report=False))
            t0 = time.perf_counter()
            res = verify_model(out, reference=a.src, device="cpu")
            secs = time.perf_counter() - t0
            db = {o.name: o.sqnr_db for o in res.outputs}
            backends = ", ".join(f"{k} {v}" for k, v in sorted(res.backends.items()))
            print(f"{target:<13} {db.get('video', float('nan')):>9.2f} "
                  f"{db.get('audio', float('nan')):>9.2f} {db.get('hidden', float('nan')):>10.2f}"
                  f"  {'PASS' if res.passed else 'FAIL':<7} {secs:>6.1f}  {backends}")
            out.unlink()
    print("paths: " + "; ".join(path_for(t, k=512).describe() for t in a.targets))


if __name__ == "__main__":
    main()
