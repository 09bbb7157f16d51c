"""The reader's own cost: every tensor of a checkpoint read through memory-mapped reads and
touched, this checkout against another side by side, alternating, warm page cache.

    taskset -c 0 python bench/bench_reader.py IN.safetensors --baseline /path/to/old/checkout
        [--rounds 5] [--chunk-mib 64]

Each round reads every tensor of ``IN`` in row chunks of about ``--chunk-mib`` MiB (as convert's
row-chunked encoders do), sums one element per page of each chunk as a float (so every page is
faulted in), and drops the chunk's pages after use; a child process per round and tree, the
trees alternating so both see the same machine state. Prints each round and the best of each
tree, in GB/s of tensor data. The file should fit in the page cache (a one-block full-width
synthetic, 2.4 GB), so the disk is out of the figure. Pin it to one core: the machine is noisy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time
import torch
from h3quant.formats.container.reader import SafetensorsFile
path, chunk = sys.argv[1], int(sys.argv[2])
total, acc = 0, 0.0
t0 = time.perf_counter()
with SafetensorsFile(path) as sf:
    for info in sf.tensors.values():
        if not info.nbytes:
            continue
        rows = info.shape[0] if info.shape else 1
        row = info.nbytes // rows
        step = max(1, chunk // max(row, 1))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0) * row
            data = sf.read_bytes(info, r0 * row, n)
            t = torch.frombuffer(data, dtype=torch.uint8)
            acc += float(t[::4096].sum())
            del t, data
            sf.release_pages(info, r0 * row, n)
        total += info.nbytes
print(total / (time.perf_counter() - t0) / 1e9, acc)
"""


def one(tree: Path, src: Path, chunk: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(chunk)], check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tree)))
    return float(out.stdout.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=64)
    a = ap.parse_args()
    chunk = a.chunk_mib << 20
    trees = (("after", HERE), ("before", a.baseline.resolve()))
    one(HERE, a.src, chunk)  # warm the page cache
    best = {label: 0.0 for label, _ in trees}
    for r in range(a.rounds):
        cells = []
        for label, tree in trees if r % 2 == 0 else trees[::-1]:
            gbs = one(tree, a.src, chunk)
            best[label] = max(best[label], gbs)
            cells.append(f"{label} {gbs:.2f} GB/s")
        print(f"round {r + 1}: " + ", ".join(cells), flush=True)
    print(f"best of {a.rounds}: after {best['after']:.2f} GB/s, before {best['before']:.2f} GB/s, "
          f"ratio after/before {best['after'] / best['before']:.3f}")


if __name__ == "__main__":
    main()
