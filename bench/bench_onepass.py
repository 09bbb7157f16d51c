"""One-pass calibrated convert (``convert --calibrate-on``): which feedback, its times, and its
bytes against ``capture`` + ``convert --calibration``. Synthetic checkpoint; prints numbers.

    python bench/bench_onepass.py [--dir /tmp/h3onepass] [--blocks 4]
        [--formats w4a8 int8-convrot] [--calls 8]

Synthetic (``h3quant synth --preset tiny``, hidden 512, random weights): the figures show how
the two feedbacks compare on a random network, not what they give on real weights.

1. inputs A (calibration): ``--calls`` calls, seeds 0.., 64 text tokens, video 2 x 16 x 16,
   32 audio frames; inputs B (held out): 3 calls, seeds 100-102, 40 text tokens, video
   2 x 12 x 20, 24 audio frames;
2. per format: round to nearest; ``--calibrate-on A --feedback float``;
   ``--calibrate-on A --feedback quantized``; each measured whole-model on B with
   ``verify --model --reference`` (the float file): video and audio output SQNR on the runtime
   path ``verify --model`` runs (int8 and W4A8 with int8 activations), mean over B;
3. the float-feedback file against ``capture A`` + ``convert --calibration``: the tensors whose
   bytes differ and the header keys that differ;
4. per block and phase, the one-pass times (seconds, this machine), the work folder's peak
   size and the process's peak RSS so far (the whole bench's, Linux).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from h3quant.calibration.recorder import write_inputs
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.pipelines.capture import capture_statistics
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.model import ModelInputs, verify_model
from h3quant.runtime.model.model import H3Model
from h3quant.synth import synth_checkpoint


def make_inputs(d: Path, src: Path, seeds, text: int, video_hw, audio: int) -> list[Path]:
    out = []
    with H3Model.open(src) as m:
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            p = d / f"in{s}.safetensors"
            write_inputs(p, torch.randn(1, m.video_channels, 2, *video_hw, generator=g),
                         torch.randn(1, m.audio_channels, 2, audio, generator=g),
                         torch.randn(1, text, m.text_dim, generator=g),
                         0.15 + 0.8 * ((s * 0.37) % 1.0), {"seed": str(s)})
            out.append(p)
    return out


def whole_model(path, src, inputs) -> dict:
    got: dict = {"video": [], "audio": []}
    for p in inputs:
        r = verify_model(path, reference=src, device="cpu", inputs=ModelInputs.from_file(p))
        for o in r.outputs:
            if o.name in got:
                got[o.name].append(o.sqnr_db)
    return {k: statistics.mean(v) for k, v in got.items()}


def byte_diff(a_path, b_path) -> tuple[list[str], list[str]]:
    with SafetensorsFile(a_path, mmap=False) as a, SafetensorsFile(b_path, mmap=False) as b:
        names = sorted(set(a.tensors) | set(b.tensors))
        differ = [n for n in names if n not in a.tensors or n not in b.tensors
                  or a.read_bytes(a.tensors[n], 0, a.tensors[n].nbytes)
                  != b.read_bytes(b.tensors[n], 0, b.tensors[n].nbytes)]
        keys = sorted(k for k in set(a.metadata) | set(b.metadata)
                      if a.metadata.get(k) != b.metadata.get(k))
    return differ, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h3onepass"))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--formats", nargs="*", default=["w4a8", "int8-convrot"])
    args = ap.parse_args()
    d = args.dir
    d.mkdir(parents=True, exist_ok=True)
    src = d / "float.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=args.blocks, seed=0)
    (d / "A").mkdir(exist_ok=True)
    (d / "B").mkdir(exist_ok=True)
    a = make_inputs(d / "A", src, range(args.calls), 64, (16, 16), 32)
    b = make_inputs(d / "B", src, range(100, 103), 40, (12, 20), 24)
    print(f"synthetic tiny checkpoint, {args.blocks} blocks; {len(a)} calibration calls, "
          f"{len(b)} held-out calls; whole-model SQNR on the verify --model runtime path (CPU)")
    t0 = time.perf_counter()
    capture_statistics(src, a, d / "A.stats", predict=False, overwrite=True)
    print(f"capture A: {time.perf_counter() - t0:.1f} s")
    print("\n| format | rounding | video SQNR dB | audio SQNR dB | time s |")
    print("|---|---|---:|---:|---:|")
    times = {}
    for fmt in args.formats:
        runs = [("nearest", {}),
                ("two-step (capture + --calibration)", {"calibration": str(d / "A.stats")}),
                ("one pass, float feedback", {"calibrate_on": (str(d / "A"),), "feedback": "float"}),
                ("one pass, quantized feedback", {"calibrate_on": (str(d / "A"),),
                                                  "feedback": "quantized"})]
        for label, kw in runs:
            out = d / f"{fmt}_{label.split()[0]}_{kw.get('feedback', '')}.safetensors"
            t = time.perf_counter()
            rep = convert(src, out, ConvertOptions(target=fmt, overwrite=True, **kw))
            dt = time.perf_counter() - t
            q = whole_model(out, src, b)
            print(f"| {fmt} | {label} | {q['video']:.2f} | {q['audio']:.2f} | {dt:.1f} |")
            if "onepass" in rep.extra:
                times[(fmt, kw["feedback"])] = rep.extra["onepass"]["blocks"]
        differ, keys = byte_diff(d / f"{fmt}_two-step_.safetensors",
                                 d / f"{fmt}_one_float.safetensors")
        print(f"|  | float one pass vs two-step: {len(differ)} tensor(s) differ; header keys "
              f"differ: {', '.join(keys) or 'none'} | | | |")
    print("\n| format | feedback | block | capture s | factorisation s | feedback s | write s "
          "| work folder peak MB | peak RSS MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (fmt, fb), blocks in times.items():
        for t in blocks:
            print(f"| {fmt} | {fb} | {t['block']} | {t['capture']:.2f} | {t['factorisation']:.2f} "
                  f"| {t['feedback']:.2f} | {t['write']:.2f} "
                  f"| {t.get('work_bytes', 0) / 1e6:.1f} | {t.get('peak_rss_bytes', 0) / 1e6:.0f} |")


if __name__ == "__main__":
    main()
