"""Benchmark ``compare``: time per file, peak RSS, and one file's card against one
``verify --model`` plus the sampling steps (synthetic full-dimension checkpoints).

    python bench/bench_compare.py [--blocks 2] [--steps 2] [--workdir DIR]

Synthesizes (once, cached in --workdir) a full-dimension H3 bf16 file with --blocks blocks and
three files made from it: int8-convrot and W4A8 (``h3quant convert``) and GGUF Q8_0 (the gguf
package's writer and quantizer). Then, each in a fresh subprocess (peak RSS from ``os.wait4``):
- ``verify INT8 --reference BF16 --model``: wall time, peak RSS;
- ``compare INT8 --reference BF16 --steps 0`` (the one-forward part of a card);
- ``compare INT8 --reference BF16 --steps N``;
- ``compare INT8 W4A8 GGUF --reference BF16 --steps N``: wall time, peak RSS and the seconds
  each file took (from the progress log).
All runs use the verify defaults for the inputs. Prints numbers only; it asserts nothing.
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
sys.path.insert(0, str(ROOT))


def make_files(workdir: Path, blocks: int) -> dict[str, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    h3q = [sys.executable, "-m", "h3quant"]
    f = {"bf16": workdir / f"full{blocks}.safetensors",
         "int8": workdir / f"full{blocks}_int8.safetensors",
         "w4a8": workdir / f"full{blocks}_w4a8.safetensors",
         "gguf": workdir / f"full{blocks}-Q8_0.gguf"}
    if not f["bf16"].exists():
        subprocess.run(h3q + ["synth", str(f["bf16"]), "--preset", "full", "--blocks",
                              str(blocks)], check=True)
    for k, to in (("int8", "int8-convrot"), ("w4a8", "w4a8")):
        if not f[k].exists():
            subprocess.run(h3q + ["convert", str(f["bf16"]), str(f[k]), "--to", to,
                                  "--no-report", "-q"], check=True)
    if not f["gguf"].exists():
        write_gguf(f["bf16"], f["gguf"])
    return f


def write_gguf(src: Path, dst: Path) -> None:
    """Q8_0 block linears (the gguf package's quantizer), the rest F32, one tensor at a time."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.h3.topology import is_h3_block_linear

    tmp = dst.with_suffix(".partial")
    with Checkpoint(src) as ck:
        w = gguf.GGUFWriter(str(tmp), "minimax_h3", use_temp_file=False)
        names = sorted(ck.tensors)
        arrays = {}
        for n in names:  # header first: shapes and types only
            info = ck.tensors[n]
            lin = n.endswith(".weight") and is_h3_block_linear(n[:-7])
            shape = tuple(info.shape)
            t = gguf.GGMLQuantizationType.Q8_0 if lin else gguf.GGMLQuantizationType.F32
            nbytes = (int(np.prod(shape)) // 32 * 34) if lin else int(np.prod(shape)) * 4
            bshape = (shape[0], shape[1] // 32 * 34) if lin else shape
            w.add_tensor_info(n, bshape if lin else shape, np.uint8 if lin else np.float32,
                              nbytes, raw_dtype=t)
            arrays[n] = lin
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for n in names:
            a = ck.read(n).float().numpy()
            out = quantize(a, gguf.GGMLQuantizationType.Q8_0) if arrays[n] else a
            w.write_tensor_data(np.ascontiguousarray(out))
            del a, out
        w.close()
    os.replace(tmp, dst)


def measured(cmd: list[str]) -> tuple[float, int, str, str]:
    import tempfile

    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        o, e = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"{' '.join(cmd[3:6])} failed ({status}): {e[-2000:]}")
    return wall, usage.ru_maxrss * 1024, o, e


def child_card(ref: str, files: list[str], steps: int) -> None:
    """In a subprocess: one card; prints the seconds per file and the card's qualities."""
    from h3quant.pipelines.compare.run import CompareOptions, compare_files
    from h3quant.runtime.model.schedule import shifted_schedule

    marks: list[tuple[str, float]] = []

    def log(msg: str) -> None:
        marks.append((msg, time.perf_counter()))

    t0 = time.perf_counter()
    res = compare_files(files, reference=ref, options=CompareOptions(
        sigmas=tuple(shifted_schedule(steps)) if steps else None, device="cpu"), log=log)
    end = time.perf_counter()
    starts = [t for m, t in marks] + [end]
    print(json.dumps({
        "total_s": end - t0, "reference_s": starts[1] - t0,
        "per_file_s": [b - a for a, b in zip(starts[1:], starts[2:])],
        "quality_db": {os.path.basename(c.facts.path): c.quality_db for c in res.files},
        "step_s": {os.path.basename(c.facts.path): c.step_seconds
                   for c in [res.reference] + res.files}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/h3quant-bench-compare"))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_card(args.child[0], args.child[1:], args.steps)
        return
    f = make_files(args.workdir, args.blocks)
    py = [sys.executable]
    me = [*py, str(Path(__file__).resolve()), "--steps"]
    print(f"full dims, {args.blocks} blocks, {args.steps} sampler steps, CPU; synthetic files "
          f"in {args.workdir}")
    for k, p in f.items():
        print(f"  {k:5s} {p.stat().st_size / 1e9:6.2f} GB  {p.name}")
    wall, rss, _, _ = measured([*py, "-m", "h3quant", "verify", str(f["int8"]), "--reference",
                                str(f["bf16"]), "--model", "--device", "cpu", "--json"])
    print(f"verify --model (int8 vs bf16):          {wall:7.1f} s, peak RSS {rss / 1e9:.2f} GB")
    for steps, files in ((0, [f["int8"]]), (args.steps, [f["int8"]]),
                         (args.steps, [f["int8"], f["w4a8"], f["gguf"]])):
        wall, rss, out, _ = measured([*me, str(steps), "--child", str(f["bf16"]),
                                      *map(str, files)])
        r = json.loads(out)
        print(f"compare {len(files)} file(s), {steps} steps:         {wall:7.1f} s, peak RSS "
              f"{rss / 1e9:.2f} GB; reference {r['reference_s']:.1f} s, per file "
              + ", ".join(f"{s:.1f} s" for s in r["per_file_s"]))
        print(f"    seconds per sampler step: {json.dumps(r['step_s'])}")
        print(f"    quality (dB): {json.dumps(r['quality_db'])}")


if __name__ == "__main__":
    main()
