"""Peak RSS of ``h3quant convert`` per target format, this checkout and (optionally) another
side by side in one run.

    python bench/bench_convert_memory.py IN.safetensors [--baseline /path/to/old/tree]
        [--targets int8-convrot fp8 fp8-e5m2 mxfp8 nvfp4 int4-convrot] [--workers 2]

``IN``: a bf16 checkpoint (``h3quant synth IN --preset full --blocks 1`` gives the real H3
widths). Each target is converted in a subprocess (``python -m h3quant convert``, the checkout's
code first on ``PYTHONPATH``), its peak RSS and wall time taken from ``os.wait4``; runs of the
two trees alternate per target, so both see the same machine state. Prints one row per target
and tree with the peak's ratio to int8-convrot's in the same tree. Asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from child import run_h3quant

HERE = Path(__file__).resolve().parent.parent
TARGETS = ("int8-convrot", "fp8", "fp8-e5m2", "mxfp8", "nvfp4", "int4-convrot")


def run(tree: Path, src: Path, target: str, workers: int) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one convert of ``src`` to ``target`` with ``tree``'s code."""
    with tempfile.TemporaryDirectory(dir=src.parent) as d:
        child = run_h3quant(tree, ["convert", src, Path(d) / "out.safetensors", "--to", target,
                                   "--workers", workers, "-q"], cwd=Path(d))
    return child.peak_rss_mib, child.seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--baseline", type=Path, help="another checkout's root (the 'before' code)")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    trees = [("after", HERE)] + ([("before", a.baseline.resolve())] if a.baseline else [])
    peaks: dict[tuple[str, str], tuple[float, float]] = {}
    for target in a.targets:
        for label, tree in trees:
            peaks[label, target] = run(tree, a.src.resolve(), target, a.workers)
    print(f"convert {a.src.name}, --workers {a.workers}; peak RSS (MiB), ratio to int8-convrot's")
    print(f"{'target':<14} " + "  ".join(f"{label + ' MiB':>11} {'ratio':>6} {'s':>6}"
                                          for label, _ in trees))
    for target in a.targets:
        cells = []
        for label, _ in trees:
            mib, secs = peaks[label, target]
            base = peaks.get((label, "int8-convrot"))
            ratio = f"{mib / base[0]:.2f}" if base else "-"
            cells.append(f"{mib:>11.0f} {ratio:>6} {secs:>6.1f}")
        print(f"{target:<14} " + "  ".join(cells))


if __name__ == "__main__":
    main()
