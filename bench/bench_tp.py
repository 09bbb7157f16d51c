"""Benchmark: tensor parallel on CPU processes (gloo) at full H3 dims, one block.

For each tp degree: start the ranks, each reads ONLY its shard of block 0 (shared scale mode)
and runs the block on seeded inputs; reported per rank: shard load time, block forward time,
bytes held by the block linears and peak RSS (the process's high-water mark, torch included).
Wall is the whole run including process start. Without ``--file`` a full-dims 1-block int8
ConvRot file is synthesized and converted into a temp dir first (about 0.9 GB; removed after).

    python bench/bench_tp.py                              # tp 1, 2, 4; 16 tokens
    python bench/bench_tp.py --file h3_int8.safetensors --tp 1 2 4 8 --tokens 64
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _rank(ctx, path: str, tokens: int, mode: str):
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.layers import scan_checkpoint
    from h3quant.pipelines.verify.tp import block_inputs
    from h3quant.runtime.devices import parse_device
    from h3quant.runtime.loader import find_prefix
    from h3quant.runtime.tp.runner import held_bytes, shard_block

    dev = parse_device("cpu")
    with Checkpoint(path) as ckpt:
        scan = scan_checkpoint(ckpt)
        root = find_prefix(ckpt.tensors)
        t0 = time.perf_counter()
        block, info = shard_block(ckpt, scan, f"{root}blocks.0", 0, ctx.comm, mode=mode,
                                  device=dev, compute_dtype=torch.float32)
        t1 = time.perf_counter()
        x, cond = block_inputs(ckpt, root, block.hidden, tokens, 0, 0.6, torch.float32, "cpu")
        with torch.no_grad():
            ctx.comm.all_reduce(torch.zeros(1), "sum", "start barrier")
            t2 = time.perf_counter()
            block(x, cond)
            t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = torch.tensor([t1 - t0, t3 - t2, held_bytes(block), rss, info.bytes_read],
                         dtype=torch.float64)
    return [t.tolist() for t in ctx.comm.all_gather(stats, "bench figures")]


def make_file(tmp: Path) -> Path:
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    src = tmp / "full_bf16.safetensors"
    synth_checkpoint(src, preset="full", blocks=1)
    dst = tmp / "full_int8.safetensors"
    convert(src, dst, ConvertOptions(target="int8-convrot", report=False))
    src.unlink()
    return dst


def main() -> None:
    from h3quant.runtime.tp.launch import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=None, help="a full-dims quantized checkpoint")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mode", choices=["shared", "per-rank"], default="shared")
    args = ap.parse_args()
    tmp = None
    try:
        path = args.file
        if path is None:
            tmp = Path(tempfile.mkdtemp(prefix="h3q-bench-tp-"))
            t = time.perf_counter()
            path = make_file(tmp)
            print(f"made {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in "
                  f"{time.perf_counter() - t:.0f} s")
        print(f"{'tp':>3} {'wall s':>7} {'rank':>4} {'load s':>7} {'fwd s':>7} "
              f"{'held MiB':>9} {'read MiB':>9} {'peak RSS MiB':>13}")
        for tp in args.tp:
            t = time.perf_counter()
            # spawn (not fork): each rank is a fresh process, so its peak RSS is its own
            rows = spawn_ranks(_rank, tp, (str(path), args.tokens, args.mode), timeout_s=1800,
                               start_method="spawn")
            wall = time.perf_counter() - t
            for r, (load, fwd, held, rss, read) in enumerate(rows):
                print(f"{tp:>3} {wall:>7.1f} {r:>4} {load:>7.2f} {fwd:>7.2f} "
                      f"{held / 2**20:>9.0f} {read / 2**20:>9.0f} {rss / 2**20:>13.0f}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
