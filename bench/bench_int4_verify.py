"""verify's figures for INT4 ConvRot on synthetic checkpoints, on the runtime's default CPU path
(ComfyUI's eager W4A4 forward: activations rotated and quantized to int4 too), which the output
names. Prints the worst layer relative error and the worst block SQNR per seed, next to the
format's verify limits (synthetic weights, tiny widths unless --preset full).

usage: python bench/bench_int4_verify.py [--preset tiny|full] [--blocks N] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from h3quant.formats import registry
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.blocks import verify_checkpoint
from h3quant.runtime.paths import path_for
from h3quant.synth import synth_checkpoint


def _worst(res) -> tuple[float, float]:
    rel = max(c.rel_err for c in res.layers)
    sqnr = min(b.sqnr_db for b in res.block_checks)
    return rel, sqnr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--seeds", default="0,1,2,3")
    a = ap.parse_args()
    lim = registry.verify_limits("convrot_w4a4")
    print(f"convrot_w4a4 limits: layer rel err <= {lim.rel_err}, block SQNR >= "
          f"{lim.block_sqnr_db} dB; preset {a.preset}, {a.blocks} blocks (synthetic weights)")
    print(f"path: {path_for('int4-convrot', k=512).describe()} (verify on the CPU)")
    print(f"{'seed':>4}  {'worst layer rel err':>20} {'worst block SQNR dB':>20}")
    with tempfile.TemporaryDirectory() as d:
        for seed in (int(s) for s in a.seeds.split(",")):
            src, out = Path(d, f"src{seed}.safetensors"), Path(d, f"i4_{seed}.safetensors")
            synth_checkpoint(src, preset=a.preset, blocks=a.blocks, seed=seed)
            convert(src, out, ConvertOptions(target="int4-convrot"))
            rel, sqnr = _worst(verify_checkpoint(out, reference=src, device="cpu"))
            print(f"{seed:>4}  {rel:>20.4f} {sqnr:>20.2f}")
            src.unlink()
            out.unlink()


if __name__ == "__main__":
    main()
