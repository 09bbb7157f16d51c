"""Every command that reads tensor data, with default options, on a checkpoint larger than RAM.

    python bench/bench_bigfile.py --big /data/h3_32.safetensors --small /data/h3_1.safetensors
        [--work DIR] [--inputs 3] [--baseline /path/to/old/checkout] [--skip CMD ...]
        [--files both|small|big] [--timeout S] [--also-no-mmap] [--compare-steps N]

``--big``: a full-width synthetic larger than this machine's memory (``h3quant synth BIG --preset
full --blocks 32`` is 26.3 GB); ``--small``: the same with ``--blocks 1``. Both are made with
those commands when missing. For each file, each command runs in a child process (this
checkout's code), after the page cache was dropped where the machine allows it (root, Linux:
``/proc/sys/vm/drop_caches``; the table says whether it was): the I/O floor (one sequential read
of the whole file in 64 MiB reads), ``convert --to int8-convrot`` (``--also-no-mmap``: then with
``--no-mmap`` too), ``verify --blocks 1``, ``verify --model --depth 2`` (1 on the one-block
file), ``compare --no-frontier --steps 2`` (``--compare-steps``), ``capture`` over ``--inputs``
small seeded inputs files (its statistics, ~1.2 GB a block, are deleted at once) and
``plan --target-sqnr 20``. Printed per command and file: wall seconds, the bytes it read from
the disk (``ru_inblock``) and their rate, the ratio of its time to the floor's time for those
bytes, peak RSS, and the big file's peak RSS over the small file's. ``--baseline`` also runs the
other checkout's convert on the big file (the code before windowed mappings fails there).
``--timeout``: a command on the big file is stopped after that many seconds (its row says so).
Asserts nothing; every figure is from this machine, and a busy machine slows the rates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from child import Child, run_h3quant

HERE = Path(__file__).resolve().parent.parent
CHUNK = 64 << 20
COMMANDS = ("convert", "verify", "verify-model", "compare", "capture", "plan")


def drop_caches() -> bool:
    """Empty the page cache (root on Linux); False where the machine does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def io_floor(path: Path) -> tuple[float, int]:
    """(seconds, bytes) of one sequential read of ``path`` (64 MiB reads, no processing)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            total += n
    return time.perf_counter() - t0, total


def ensure(path: Path, blocks: int) -> None:
    if not path.exists():
        print(f"making {path} (synth --preset full --blocks {blocks})", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "h3quant", "synth", str(path), "--preset", "full",
                        "--blocks", str(blocks)], check=True, env=dict(os.environ,
                                                                       PYTHONPATH=str(HERE)))


def make_inputs(src: Path, work: Path, n: int) -> list[Path]:
    """``n`` small seeded inputs files for ``src`` (16 x 16 latents, 64 text tokens)."""
    code = ("import sys, torch\nfrom h3quant.calibration.recorder import write_inputs\n"
            "from h3quant.runtime.model.model import H3Model\n"
            "with H3Model.open(sys.argv[1]) as m:\n"
            "    vc, ac, td = m.video_channels, m.audio_channels, m.text_dim\n"
            "for i, p in enumerate(sys.argv[2:]):\n"
            "    g = torch.Generator().manual_seed(i)\n"
            "    write_inputs(p, torch.randn(1, vc, 2, 16, 16, generator=g),\n"
            "                 torch.randn(1, ac, 2, 32, generator=g),\n"
            "                 torch.randn(1, 64, td, generator=g), 0.3 + 0.2 * i, {})\n")
    paths = [work / f"in{i}.safetensors" for i in range(n)]
    if not all(p.exists() for p in paths):
        subprocess.run([sys.executable, "-c", code, str(src), *map(str, paths)], check=True,
                       env=dict(os.environ, PYTHONPATH=str(HERE)))
    return paths


def args_for(cmd: str, src: Path, q: Path, work: Path, inputs: list[Path], depth: int,
             steps: int = 2) -> list:
    ins = [a for p in inputs for a in ("--inputs", p)]
    return {
        "convert": ["convert", src, q, "--to", "int8-convrot", "--overwrite"],
        "verify": ["verify", q, "--reference", src, "--blocks", "1"],
        "verify-model": ["verify", q, "--reference", src, "--model", "--depth", depth],
        "plan": ["plan", src, "--target-sqnr", "20", "--out", work / "recipe.json",
                 "--overwrite"],
        "compare": ["compare", q, "--reference", src, "--no-frontier", "--steps", steps],
        "capture": ["capture", src, *ins, "--out", work / "h3.stats", "--overwrite",
                    "--no-predict"],
    }[cmd]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", type=Path, required=True)
    ap.add_argument("--small", type=Path, required=True)
    ap.add_argument("--big-blocks", type=int, default=32)
    ap.add_argument("--work", type=Path, default=None, help="outputs (default: beside --big)")
    ap.add_argument("--inputs", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout: its convert on --big")
    ap.add_argument("--skip", nargs="*", default=[], choices=COMMANDS)
    ap.add_argument("--compare-steps", type=int, default=2,
                    help="compare's sampling run (0: the one-forward comparison only)")
    ap.add_argument("--also-no-mmap", action="store_true",
                    help="also run convert with --no-mmap (buffered reads) right after it")
    ap.add_argument("--files", choices=("both", "small", "big"), default="both",
                    help="run the commands on these files only (a row needs the small file's "
                         "run for its RSS ratio)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after which a command on the big file is stopped (its row "
                         "then says how far it got: exit -9, peak RSS until then)")
    a = ap.parse_args()
    ensure(a.big, a.big_blocks)
    ensure(a.small, 1)
    work = (a.work or a.big.parent).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"machine: {os.cpu_count()} cores, {ram / 1e9:.2f} GB RAM; big file "
          f"{a.big.stat().st_size / 1e9:.2f} GB, small {a.small.stat().st_size / 1e9:.2f} GB")
    inputs = make_inputs(a.small, work, a.inputs)
    rows: list[tuple[str, str, Child | None, bool]] = []
    floors: dict[str, float] = {}
    for label, src, depth in (("small", a.small.resolve(), 1), ("big", a.big.resolve(), 2)):
        if a.files not in ("both", label):
            continue
        cold = drop_caches()
        secs, nbytes = io_floor(src)
        floors[label] = nbytes / secs
        print(f"{label}: I/O floor {nbytes / 1e9:.2f} GB in {secs:.1f} s = "
              f"{nbytes / secs / 1e6:.0f} MB/s ({'cold' if cold else 'warm'} cache)", flush=True)
        q = work / f"{src.stem}_int8-convrot.safetensors"
        if label == "big" and a.baseline:
            drop_caches()
            child = run_h3quant(a.baseline.resolve(), args_for("convert", src, q, work, inputs, depth),
                                cwd=work, check=False)
            rows.append(("convert (before)", label, child, True))
            print(f"  baseline convert exit {child.exit_code}: "
                  f"{child.stderr.strip().splitlines()[-1] if child.stderr.strip() else ''}")
        commands = [c for c in COMMANDS for c in ((c, c + " --no-mmap") if c == "convert"
                                                  and a.also_no_mmap else (c,))]
        for cmd in commands:
            if cmd == "capture":  # the converted file is no longer needed: its disk goes to
                q.unlink(missing_ok=True)  # the statistics (~1.2 GB a block)
            if cmd.split()[0] in a.skip:
                continue
            cold = drop_caches()
            extra = cmd.split()[1:]
            child = run_h3quant(HERE, args_for(cmd.split()[0], src, q, work, inputs, depth,
                                         a.compare_steps)
                                + extra, cwd=work,
                                check=False, timeout=a.timeout if label == "big" else None)
            rows.append((cmd, label, child, cold))
            print(f"  {cmd:<19} exit {child.exit_code}  {child.seconds:7.1f} s  "
                  f"{child.peak_rss_mib:7.0f} MiB peak RSS", flush=True)
            if child.exit_code == -9:
                for stale in work.glob(".h3quant-staging-*"):  # a killed run's temporaries
                    shutil.rmtree(stale, ignore_errors=True)
                last = child.stderr.strip().replace("\r", "\n").splitlines()
                print(f"    stopped after {a.timeout:.0f} s; last progress: "
                      f"{last[-1][-300:] if last else '-'}", flush=True)
            elif child.exit_code:
                print("    " + child.stderr.strip()[-600:], flush=True)
            (work / "h3.stats").unlink(missing_ok=True)
        q.unlink(missing_ok=True)
    small = {cmd: c for cmd, lab, c, _ in rows if lab == "small" and c is not None}
    print()
    print(f"{'command':<19} {'file':<6} {'exit':>4} {'s':>8} {'GB read':>8} {'MB/s':>7} "
          f"{'x floor':>7} {'peak MiB':>9} {'x small':>7} cache")
    for cmd, label, c, cold in rows:
        if c is None:
            continue
        read = c.disk_read_bytes
        rate = read / c.seconds / 1e6 if c.seconds else 0.0
        floor = c.seconds / (read / floors[label]) if read else float("nan")
        base = small.get(cmd)
        ratio = (f"{c.peak_rss_mib / base.peak_rss_mib:.2f}" if base is not None
                 and label == "big" and not cmd.endswith("(before)") else "-")
        print(f"{cmd:<19} {label:<6} {c.exit_code:>4} {c.seconds:>8.1f} {read / 1e9:>8.2f} "
              f"{rate:>7.0f} {floor:>7.2f} {c.peak_rss_mib:>9.0f} {ratio:>7} "
              f"{'cold' if cold else 'warm'}")


if __name__ == "__main__":
    main()
