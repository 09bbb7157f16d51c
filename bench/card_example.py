"""The README's example card: a synthetic tiny H3, every format h3quant writes, GGUF files
written with the gguf package, one file with a planted defect; then ``h3quant compare`` over all
of them (markdown, JSON and plot written to OUT_DIR; compare exits 1 there, since the defect is
flagged).

    python bench/card_example.py /tmp/card [--blocks 4] [--steps 8]

Random weights: the card ranks how much each format disturbs this synthetic model, not how a
real H3 file of that format will look.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's GGUF writer and file helpers

FORMATS = ("int8-convrot", "w4a8", "fp8", "mxfp8", "nvfp4", "int4-convrot")
MIXES = {"h3_mix_nvfp4_int8": ["--layer", r"mlp\.=nvfp4", "--layer", r"attn\.=int8-convrot"],
         "h3_mixed": ["--layer", r"mlp\.=w4a8", "--layer", r"attn\.=int8-convrot"]}


def h3quant(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "h3quant", *args], check=True)


def _bad_scales(layer, parts, w):
    """block 1's fc2 scales rolled by one row: the planted defect."""
    if layer == "blocks.1.mlp.fc2":
        parts = {**parts, "weight_scale": parts["weight_scale"].roll(1, dims=0)}
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    from helpers.gguf_files import write_gguf
    from helpers.h3files import quantize_file, read_tensors

    d = a.out_dir
    d.mkdir(parents=True, exist_ok=True)
    ref = d / "h3_bf16.safetensors"
    if not ref.exists():
        h3quant("synth", str(ref), "--blocks", str(a.blocks), "--seed", "0")
    files = []
    for fmt in FORMATS:
        out = d / f"h3_{fmt}.safetensors"
        if not out.exists():
            h3quant("convert", str(ref), str(out), "--to", fmt, "--no-report", "-q")
        files.append(out)
    for name, rules in MIXES.items():
        out = d / f"{name}.safetensors"
        if not out.exists():
            h3quant("convert", str(ref), str(out), *rules, "--no-report", "-q")
        files.append(out)
    tensors, _ = read_tensors(ref)
    for q in ("Q8_0", "Q4_K", "Q4_0"):
        out = d / f"h3-{q}.gguf"
        if not out.exists():
            write_gguf(tensors, out, q)
        files.append(out)
    bad = d / "h3_int8_bad_scales.safetensors"
    if not bad.exists():
        quantize_file(ref, bad, mutate=_bad_scales)
    files.append(bad)
    t0 = time.perf_counter()
    cmd = ["compare", *map(str, files), "--reference", str(ref), "--steps", str(a.steps),
           "--markdown", str(d / "card.md"), "--plot", str(d / "card.png"), "--overwrite"]
    with open(d / "card.json", "w") as fh:  # exit 1: the planted defect is flagged
        rc = subprocess.run([sys.executable, "-m", "h3quant", *cmd, "--json"],
                            stdout=fh).returncode
    if rc not in (0, 1):
        raise SystemExit(f"compare failed (exit {rc})")
    print(f"card of {len(files)} files in {time.perf_counter() - t0:.1f} s: {d / 'card.md'}")
    print((d / "card.md").read_text())


if __name__ == "__main__":
    main()
