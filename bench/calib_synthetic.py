"""Calibrated against uncalibrated conversion on a synthetic H3 checkpoint, measured end to end.

    python bench/calib_synthetic.py [--dir /tmp/h3calib] [--blocks 8]
        [--formats int8-convrot w4a8 nvfp4 int4-convrot] [--through FMT ...] [--few]

Synthetic (``h3quant synth --preset tiny``): hidden 512, random weights with a few outlier input
channels; the inputs are seeded random latents. So the activations are those of a random
network, far more low-rank than a trained DiT's are likely to be: the figures show that the
machinery works and how it behaves, not what calibration gains on real weights.

1. inputs A (calibration): 8 calls, seeds 0-7, sigmas 0.15-0.95, 64 text tokens, video
   2 x 16 x 16, 32 audio frames; inputs B (held out): 3 calls, seeds 100-102, other sigmas,
   40 text tokens, video 2 x 12 x 20, 24 audio frames;
2. ``capture`` on A (with the predicted gains) and on B;
3. per format: ``convert`` uncalibrated (round to nearest) and ``convert --calibration A``;
   per layer, output SQNR ``10 log10(tr(W H W^T) / tr(E H E^T))`` of every row over H of A and
   of B (float activations);
4. whole model with activation quantization: ``verify --model --reference`` (the float file) on
   each B input, the video and audio outputs' SQNR (mean over B);
5. ``--through FMT``: the same with statistics captured through the uncalibrated file
   (``capture --through``: each block measured on the inputs the quantized blocks before it
   produce);
6. ``--few``: too few rows: one layer calibrated on one call (256 rows < K), measured on B.

Prints markdown tables (per layer, then a summary per format) and the time of each step.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from h3quant.calibration.gptq import output_sqnr_db
from h3quant.calibration.recorder import write_inputs
from h3quant.calibration.stats import LayerStats, Statistics, layer_key
from h3quant.formats import registry
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.pipelines.capture import capture_statistics
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.model import ModelInputs, verify_model
from h3quant.runtime.model.model import H3Model
from h3quant.synth import synth_checkpoint


def make_inputs(d: Path, m, tag, seeds, sigmas, text, video_hw, audio):
    out = []
    for s, sg in zip(seeds, sigmas):
        g = torch.Generator().manual_seed(s)
        p = d / f"{tag}{s}.safetensors"
        write_inputs(p, torch.randn(1, m.video_channels, 2, *video_hw, generator=g),
                     torch.randn(1, m.audio_channels, 2, audio, generator=g),
                     torch.randn(1, text, m.text_dim, generator=g), sg, {"seed": str(s)})
        out.append(p)
    return out


def decoded(path) -> dict[str, torch.Tensor]:
    """Every block linear of ``path`` decoded to fp32 (original basis)."""
    out = {}
    with Checkpoint(path) as c:
        scan = scan_checkpoint(c)
        for name, lay in scan.layers.items():
            if layer_key(name) is not None and lay.weight is not None:
                codec = registry.codec_for(lay.fields)
                rows, whole = codec.source_tensors(lay.fields, lay.tensors)
                t = {s: c.read(lay.tensors[s].name) for s in rows}
                w = {s: c.read(lay.tensors[s].name) for s in whole}
                n, k = registry.logical_shape(tuple(lay.weight.shape), lay.fields)
                out[name] = codec.decode_rows(t, w, lay.fields).float()[:n, :k]  # no padding
    return out


def whole_model(path, src, inputs) -> dict[str, float]:
    got = {"video": [], "audio": []}
    for p in inputs:
        r = verify_model(path, reference=src, device="cpu", inputs=ModelInputs.from_file(p))
        for o in r.outputs:
            if o.name in got:
                got[o.name].append(o.sqnr_db)
    return {k: statistics.mean(v) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h3calib"))
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--formats", nargs="*", default=["int8-convrot", "w4a8", "nvfp4",
                                                     "int4-convrot"])
    ap.add_argument("--through", nargs="*", default=[],
                    help="formats also calibrated on statistics captured through their "
                         "uncalibrated file")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse A.stats and B.stats of an earlier run in --dir")
    ap.add_argument("--few", action="store_true",
                    help="also the too-few-rows table (W4A8 forced on one call's statistics)")
    args = ap.parse_args()
    d = args.dir
    d.mkdir(parents=True, exist_ok=True)
    src = d / "bf16.safetensors"
    if not src.exists():
        synth_checkpoint(src, preset="tiny", blocks=args.blocks, seed=0)
    with H3Model.open(src) as m:
        a = make_inputs(d, m, "A", range(8), [0.15 + 0.1 * i for i in range(8)], 64, (16, 16), 32)
        b = make_inputs(d, m, "B", range(100, 103), [0.33, 0.58, 0.81], 40, (12, 20), 24)
    if args.reuse and (d / "A.stats").exists() and (d / "B.stats").exists():
        print("statistics A and B reused from an earlier run of this script\n")
    else:
        t0 = time.perf_counter()
        cap_a = capture_statistics(src, a, d / "A.stats", overwrite=True, predict=False)
        t_cap = time.perf_counter() - t0
        capture_statistics(src, b, d / "B.stats", overwrite=True, predict=False)
        print(f"capture A: {cap_a.rows} rows per layer, {len(a)} calls, {t_cap:.1f} s "
              f"({t_cap / args.blocks:.2f} s per block)\n")
    src_w = decoded(src)
    sa, sb = Statistics(d / "A.stats"), Statistics(d / "B.stats")
    summary = []
    for fmt in args.formats:
        tf = time.perf_counter()
        codec = registry.target_codec(fmt)
        marker = codec.spec.marker(registry.target(fmt), 256)
        convrot = codec.spec.uses_convrot(marker)  # the basis the format quantizes in
        rtn, cal = d / f"{fmt}_rtn.safetensors", d / f"{fmt}_cal.safetensors"
        t0 = time.perf_counter()
        convert(src, rtn, ConvertOptions(target=fmt, report=False, overwrite=True))
        t_rtn = time.perf_counter() - t0
        t0 = time.perf_counter()
        convert(src, cal, ConvertOptions(target=fmt, report=False, overwrite=True,
                                         calibration=str(d / "A.stats")))
        t_conv = time.perf_counter() - t0
        wr, wc = decoded(rtn), decoded(cal)
        rows = {}
        for k in sorted(src_w, key=lambda n: (int(n.split(".")[1]), n)):
            lay = sa.layer(k)
            pred = lay.predicted_gain_db(convrot, 256)
            lay.release()
            rows[k] = (pred,) + tuple(output_sqnr_db(src_w[k], w[k], st.layer(k).hessian())
                                      for st in (sa, sb) for w in (wr, wc))
        print(f"### {fmt}: per layer output SQNR (dB, float activations)\n")
        print("| layer | predicted gain | A: RTN | A: calibrated | B: RTN | B: calibrated | "
              "B gain |")
        print("|---|---|---|---|---|---|---|")
        for k, (p, ar, ac, br, bc) in rows.items():
            print(f"| {k} | {p:+.1f} | {ar:.1f} | {ac:.1f} | {br:.1f} | {bc:.1f} | {bc - br:+.1f} |")
        gains_b = [v[4] - v[3] for v in rows.values()]
        gains_a = [v[2] - v[1] for v in rows.values()]
        preds = [v[0] for v in rows.values()]
        t0 = time.perf_counter()
        m_rtn = whole_model(rtn, src, b)
        m_cal = whole_model(cal, src, b)
        t_verify = time.perf_counter() - t0
        line = {"format": fmt, "pred": statistics.mean(preds), "gain_a": statistics.mean(gains_a),
                "gain_b": statistics.mean(gains_b), "min_b": min(gains_b),
                "rtn": m_rtn, "cal": m_cal, "convert_s": t_conv, "rtn_s": t_rtn}
        if fmt in args.through:
            sq = d / f"{fmt}_seq.stats"
            capture_statistics(src, a, sq, through=rtn, overwrite=True, predict=False)
            seq = d / f"{fmt}_seq.safetensors"
            convert(src, seq, ConvertOptions(target=fmt, report=False, overwrite=True,
                                             calibration=str(sq)))
            line["seq"] = whole_model(seq, src, b)
        summary.append(line)
        print(f"\nmean over {len(rows)} layers: predicted {line['pred']:+.1f} dB, measured on A "
              f"{line['gain_a']:+.1f} dB, on held-out B {line['gain_b']:+.1f} dB (worst layer "
              f"{line['min_b']:+.1f}); calibrated convert {t_conv:.1f} s "
              f"({t_conv / args.blocks:.2f} s per block; uncalibrated {t_rtn:.1f} s); "
              f"{2 * len(b)} verify runs {t_verify:.1f} s; format total "
              f"{time.perf_counter() - tf:.1f} s\n", flush=True)
    print("### summary per format (mean over the layers; whole model: verify --model "
          "--reference, mean over held-out B)\n")
    print("| format | predicted gain | gain on A | gain on B | worst layer on B | video RTN | "
          "video calibrated | audio RTN | audio calibrated | convert RTN / calibrated (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['format']} | {s['pred']:+.1f} | {s['gain_a']:+.1f} | {s['gain_b']:+.1f} | "
              f"{s['min_b']:+.1f} | {s['rtn']['video']:.2f} | {s['cal']['video']:.2f} | "
              f"{s['rtn']['audio']:.2f} | {s['cal']['audio']:.2f} | "
              f"{s['rtn_s']:.1f} / {s['convert_s']:.1f} |")
    if args.through:
        through_table(summary)
    if not args.few:
        sa.close()
        sb.close()
        return
    few_table(src, a, d, src_w, sa, sb)


def through_table(summary) -> None:
    print("\n### whole model, activation quantization (verify --model --reference, mean over "
          "held-out B)\n")
    print("| format | video RTN | video calibrated (float inputs) | video calibrated "
          "(quantized-block inputs) | audio RTN | audio calibrated (float) | audio calibrated "
          "(quantized) |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        seq = s.get("seq", {})
        print(f"| {s['format']} | {s['rtn']['video']:.2f} | {s['cal']['video']:.2f} | "
              f"{seq.get('video', float('nan')):.2f} | {s['rtn']['audio']:.2f} | "
              f"{s['cal']['audio']:.2f} | {seq.get('audio', float('nan')):.2f} |")


def few_table(src, a, d, src_w, sa, sb) -> None:
    # too few rows: one call (256 rows) for fc1 (K = 512), error feedback forced
    few = capture_statistics(src, a[:1], d / "few.stats", overwrite=True, predict=False)
    with Statistics(d / "few.stats") as sf:
        print(f"\n### too few rows ({few.rows} rows < K), W4A8, error feedback forced, held-out B\n")
        print("| layer | K | B: RTN | B: calibrated on too few rows | B: calibrated on A |")
        print("|---|---|---|---|---|")
        codec = registry.target_codec("w4a8")
        marker = codec.spec.marker(registry.target("w4a8"), 256)
        for k in ("blocks.3.attn.qkv_proj", "blocks.3.mlp.fc1", "blocks.3.mlp.fc2"):
            lay = sf.layer(k)
            forced = LayerStats.from_hessian(k, lay.hessian(), 1 << 30)
            w = src_w[k]
            out_few = codec.encode(w, marker, "exact", calibration=forced)
            out_rtn = codec.encode(w, marker, "exact")
            out_a = codec.encode(w, marker, "exact", calibration=sa.layer(k))
            hb = sb.layer(k).hessian()
            vals = [output_sqnr_db(w, codec.report_grid(o, marker)[0], hb)
                    for o in (out_rtn, out_few, out_a)]
            print(f"| {k} | {lay.k} | {vals[0]:.1f} | {vals[1]:.1f} | {vals[2]:.1f} |")
    sa.close()
    sb.close()


if __name__ == "__main__":
    main()
