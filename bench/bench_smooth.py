"""Plain vs calibrated vs calibrated + smoothed, whole model, on a tiny SYNTHETIC H3.

    python bench/bench_smooth.py [--blocks 8] [--formats int4-convrot w4a8 nvfp4 int8-convrot]
                                 [--variants plain calibrated smoothed aware smoothed+aware]

Everything here is synthetic: ``h3quant synth --preset tiny`` weights and seeded random latents.

* calibration: 6 inputs files spanning two latent sizes (video 2 x 16 x 16 with 32 audio frames
  and 64 text tokens; video 2 x 12 x 20 with 24 audio frames and 40 text tokens), seeds 0-5,
  sigmas 0.15-0.9; statistics captured on the float file (``h3quant capture``);
* held out: 4 files, both sizes, other seeds (100-103) and sigmas (0.33, 0.47, 0.62, 0.81);
* per format, three files: rounding to nearest (plain), ``--calibration`` (calibrated),
  ``--calibration --smooth auto`` (calibrated + smoothed); with ``--variants``, also
  ``--activation-aware auto`` without (aware) and with smoothing (smoothed+aware);
* each measured with ``verify --model --reference FLOAT`` on the runtime's default CPU path
  (the path ComfyUI runs each format on without its kernel: INT4 ConvRot through comfy-kitchen's
  eager W4A4, int4 activations; W4A8 and int8 on the int8 grid with per-token int8 activations;
  nvfp4 dequantized, float activations), per held-out file: the video and audio output SQNR and
  every block's hidden-state SQNR.

Prints, per format and held-out file, the worse of video / audio for each file and the gain over
plain, then the worst per-block change against plain over all held-out files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from h3quant.calibration.recorder import write_inputs
from h3quant.pipelines.capture import capture_statistics
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.model import ModelInputs, verify_model
from h3quant.runtime.model.model import H3Model
from h3quant.synth import synth_checkpoint

SIZES = {"A": ((16, 16), 32, 64), "B": ((12, 20), 24, 40)}  # video h x w, audio frames, text
CALIB = [(0, "A", 0.15), (1, "A", 0.5), (2, "A", 0.9), (3, "B", 0.3), (4, "B", 0.65),
         (5, "B", 0.8)]
HELDOUT = [(100, "A", 0.33), (101, "B", 0.47), (102, "A", 0.62), (103, "B", 0.81)]


VARIANTS = {"plain": {}, "calibrated": {"calibration": "STATS"},
            "smoothed": {"calibration": "STATS", "smooth": "auto"},
            "aware": {"calibration": "STATS", "activation_aware": "auto"},
            "smoothed+aware": {"calibration": "STATS", "smooth": "auto",
                               "activation_aware": "auto"}}


def make_inputs(d: Path, m, tag: str, spec) -> list[Path]:
    out = []
    for seed, size, sigma in spec:
        (h, w), audio, text = SIZES[size]
        g = torch.Generator().manual_seed(seed)
        p = d / f"{tag}{seed}{size}.safetensors"
        write_inputs(p, torch.randn(1, m.video_channels, 2, h, w, generator=g),
                     torch.randn(1, m.audio_channels, 2, audio, generator=g),
                     torch.randn(1, text, m.text_dim, generator=g), sigma, {"seed": str(seed)})
        out.append(p)
    return out


def measure(path: Path, src: Path, inputs) -> list[dict]:
    out = []
    for p in inputs:
        r = verify_model(path, reference=src, device="cpu", inputs=ModelInputs.from_file(p))
        o = {x.name: x.sqnr_db for x in r.outputs}
        out.append({"video": o["video"], "audio": o["audio"],
                    "blocks": [d.sqnr_db for d in r.drift], "backends": dict(r.backends)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h3smooth"))
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", nargs="*",
                    default=["int4-convrot", "w4a8", "nvfp4", "int8-convrot"])
    ap.add_argument("--variants", nargs="+", default=["plain", "calibrated", "smoothed"],
                    choices=list(VARIANTS), help="plain is always measured (the gains' base)")
    args = ap.parse_args()
    d = args.dir
    d.mkdir(parents=True, exist_ok=True)
    src = d / "float.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=args.blocks, seed=args.seed)
    with H3Model.open(src) as m:
        calib = make_inputs(d, m, "c", CALIB)
        held = make_inputs(d, m, "h", HELDOUT)
    stats = d / "calib.stats"
    t0 = time.perf_counter()
    capture_statistics(src, calib, stats, predict=False, overwrite=True)
    print(f"SYNTHETIC tiny H3, {args.blocks} blocks (seed {args.seed}); capture "
          f"{time.perf_counter() - t0:.1f} s; held-out files: "
          + ", ".join(f"seed {s} size {z} sigma {g}" for s, z, g in HELDOUT))
    variants = {name: {k: (str(stats) if v == "STATS" else v) for k, v in kw.items()}
                for name, kw in VARIANTS.items() if name == "plain" or name in args.variants}
    for fmt in args.formats:
        res, secs = {}, {}
        for name, kw in variants.items():
            out = d / f"{fmt}_{name}.safetensors"
            t0 = time.perf_counter()
            rep = convert(src, out, ConvertOptions(target=fmt, overwrite=True, **kw))
            secs[name] = time.perf_counter() - t0
            res[name] = measure(out, src, held)
            if name.startswith("smoothed"):
                sm = rep.extra.get("smoothing", {})
                n_s = sum(1 for v in sm.values() if v.get("smoothed"))
                secs[f"{name} layers"] = f"{n_s}/{len(sm)} smoothed"
        path = res["plain"][0]["backends"]
        print(f"\n### {fmt} (verify --model, CPU default path: {path}); convert s: "
              + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else v for k, v in secs.items()))
        names = list(variants)
        print("| held-out file | " + " | ".join(f"{k} video / audio" for k in names)
              + " | worse of v/a: " + " | ".join(names) + " | "
              + " | ".join(f"gain {k}" for k in names[1:]) + " |")
        print("|---" * (1 + 2 * len(names) + len(names) - 1) + "|")
        worst_block = {k: float("inf") for k in names[1:]}
        for i, (seed, size, sigma) in enumerate(HELDOUT):
            r = {k: res[k][i] for k in res}
            worse = {k: min(v["video"], v["audio"]) for k, v in r.items()}
            print(f"| {seed} {size} s={sigma} | "
                  + " | ".join(f"{r[k]['video']:.2f} / {r[k]['audio']:.2f}" for k in r)
                  + " | " + " | ".join(f"{worse[k]:.2f}" for k in r) + " | "
                  + " | ".join(f"{worse[k] - worse['plain']:+.2f}" for k in names[1:]) + " |")
            for k in worst_block:
                diffs = [a - b for a, b in zip(r[k]["blocks"], r["plain"]["blocks"])]
                worst_block[k] = min(worst_block[k], min(diffs))
        print("worst block hidden-state SQNR change against plain (all held-out files): "
              + ", ".join(f"{k} {v:+.2f} dB" for k, v in worst_block.items()))


if __name__ == "__main__":
    main()
