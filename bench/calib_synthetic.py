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
2. ``capture`` on A (with the predicted gains); the float model's input rows of every block
   linear on B, kept (fp32, the CPU compute dtype of ``verify --model``);
3. per format: ``convert`` uncalibrated (round to nearest) and ``convert --calibration A``;
   per layer, the output SQNR ``|X W^T|^2 / |Y - X W^T|^2`` on B's rows, ``Y`` computed by the
   layer as the runtime runs it (``runtime.model.block.quantized_linear``, the module
   ``verify --model`` builds: INT4 ConvRot with int4 activations, int8 and W4A8 with int8
   activations, nvfp4 dequantized); the path is printed with each table;
4. whole model, the same runtime path: ``verify --model --reference`` (the float file) on each
   B input, the video and audio outputs' SQNR (mean over B), with the backends that ran;
5. ``--through FMT``: the same with statistics captured through the uncalibrated file
   (``capture --through``: each block measured on the inputs the quantized blocks before it
   produce);
6. ``--few``: too few rows: one layer calibrated on one call (256 rows < K), measured on B.

Prints markdown tables (per layer, then a summary per format) and the time of each step.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from h3quant.calibration.recorder import write_inputs
from h3quant.calibration.stats import LINEARS
from h3quant.calibration.stats import LayerStats, Statistics, layer_key
from h3quant.formats import registry
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.pipelines.capture import capture_statistics
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.inputs_file import load_tensors
from h3quant.pipelines.verify.model import ModelInputs, verify_model
from h3quant.runtime.loader import load_blocks
from h3quant.runtime.model.block import quantized_linear
from h3quant.runtime.model.model import H3Model
from h3quant.runtime.paths import layer_path, runtime_layer
from h3quant.synth import synth_checkpoint

ATTRS = dict(zip(LINEARS, ("qkv_proj", "out_proj", "fc1", "fc2")))
DTYPE = torch.float32  # verify --model's compute dtype on the CPU


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
                rows, whole = codec.decoder.source_tensors(lay.fields, lay.tensors)
                t = {s: c.read(lay.tensors[s].name) for s in rows}
                w = {s: c.read(lay.tensors[s].name) for s in whole}
                n, k = registry.logical_shape(tuple(lay.weight.shape), lay.fields)
                out[name] = codec.decoder.decode_rows(t, w, lay.fields).float()[:n, :k]  # no padding
    return out


class Keep(torch.nn.Module):
    """A float linear that keeps its input rows (the float model's activations)."""

    def __init__(self, inner, rows: list):
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x, input_act=None):
        from h3quant.runtime.model.block import swiglu

        if input_act == "swiglu":
            x, input_act = swiglu(x), None
        self.rows.append(x.reshape(-1, x.shape[-1]).to(DTYPE).clone())
        return self.inner(x, input_act=input_act) if input_act else self.inner(x)


def layer_inputs(src, inputs) -> dict[str, torch.Tensor]:
    """Every block linear's input rows over ``inputs``, from the float model (block by block,
    as capture runs it)."""
    out: dict[str, list] = {}
    with H3Model.open(src, "cpu", linear="reference") as m, torch.no_grad():
        states = []
        for p in inputs:
            v, a, t = load_tensors(p, m.video_channels, m.audio_channels, m.text_dim)
            sigma = ModelInputs.from_file(p).sigma
            states.append(m.start(v.to(DTYPE), a.to(DTYPE), t.to(DTYPE), sigma))
        for i in m.blocks:
            block = m.load_block(i, DTYPE)
            for lin, attr in ATTRS.items():
                setattr(block, attr, Keep(getattr(block, attr), out.setdefault(
                    f"blocks.{i}.{lin}", [])))
            for st in states:
                st.x = block(st.x, st.cond)
            m.release_block(i)
    return {k: torch.cat(v) for k, v in out.items()}


def runtime_layers(path, src_w, rows) -> tuple[dict[str, float], set[str]]:
    """Per block linear of ``path``: its output SQNR on ``rows`` as the runtime runs it (the
    module ``verify --model`` builds on the CPU), and the paths that ran."""
    out, paths = {}, set()
    for block in load_blocks(path):
        for lin in LINEARS:
            key = f"blocks.{block.index}.{lin}"
            layer = block.linear(lin)
            module = quantized_linear(layer, device="cpu", compute_dtype=DTYPE)
            paths.add(layer_path(module, DTYPE, (layer.fields or {}).get("format")).describe())
            x = rows[key]
            with torch.no_grad():
                y = module(x)
                if layer.bias is not None:
                    y = y - layer.bias.to(y.dtype)
                ref = x @ src_w[key].t()
            err = float((y.double() - ref.double()).pow(2).sum())
            out[key] = 10 * math.log10(float(ref.double().pow(2).sum()) / max(err, 1e-30))
    return out, paths


def whole_model(path, src, inputs) -> dict:
    got: dict = {"video": [], "audio": []}
    backends: dict[str, int] = {}
    for p in inputs:
        r = verify_model(path, reference=src, device="cpu", inputs=ModelInputs.from_file(p))
        for o in r.outputs:
            if o.name in got:
                got[o.name].append(o.sqnr_db)
        for k, v in r.backends.items():
            backends[k] = backends.get(k, 0) + v
    res = {k: statistics.mean(v) for k, v in got.items()}
    res["backends"] = ", ".join(sorted(backends))
    return res


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
    if args.reuse and (d / "A.stats").exists():
        print("statistics A reused from an earlier run of this script\n")
    else:
        t0 = time.perf_counter()
        cap_a = capture_statistics(src, a, d / "A.stats", overwrite=True, predict=False)
        t_cap = time.perf_counter() - t0
        print(f"capture A: {cap_a.rows} rows per layer, {len(a)} calls, {t_cap:.1f} s "
              f"({t_cap / args.blocks:.2f} s per block)\n")
    src_w = decoded(src)
    rows_a, rows_b = layer_inputs(src, a), layer_inputs(src, b)
    sa = Statistics(d / "A.stats")
    summary = []
    for fmt in args.formats:
        tf = time.perf_counter()
        codec = registry.target_codec(fmt)
        marker = codec.spec.planning.marker(registry.target(fmt), 256)
        convrot = codec.spec.reading.uses_convrot(marker)  # the basis the format quantizes in
        rtn, cal = d / f"{fmt}_rtn.safetensors", d / f"{fmt}_cal.safetensors"
        t0 = time.perf_counter()
        convert(src, rtn, ConvertOptions(target=fmt, report=False, overwrite=True))
        t_rtn = time.perf_counter() - t0
        t0 = time.perf_counter()
        convert(src, cal, ConvertOptions(target=fmt, report=False, overwrite=True,
                                         calibration=str(d / "A.stats")))
        t_conv = time.perf_counter() - t0
        (ar, paths), (ac, _) = runtime_layers(rtn, src_w, rows_a), runtime_layers(cal, src_w, rows_a)
        (br, _), (bc, _) = runtime_layers(rtn, src_w, rows_b), runtime_layers(cal, src_w, rows_b)
        rows = {}
        for k in sorted(src_w, key=lambda n: (int(n.split(".")[1]), n)):
            lay = sa.layer(k)
            pred = lay.predicted_gain_db(convrot, 256)
            lay.release()
            rows[k] = (pred, ar[k], ac[k], br[k], bc[k])
        path = "; ".join(sorted(paths))
        print(f"### {fmt}: per layer output SQNR (dB) on the runtime path: {path}\n")
        print("| layer | predicted gain | A: RTN | A: calibrated | B: RTN | B: calibrated | "
              "B gain |")
        print("|---|---|---|---|---|---|---|")
        for k, (p, xr, xc, yr, yc) in rows.items():
            print(f"| {k} | {p:+.1f} | {xr:.1f} | {xc:.1f} | {yr:.1f} | {yc:.1f} | {yc - yr:+.1f} |")
        gains_b = [v[4] - v[3] for v in rows.values()]
        gains_a = [v[2] - v[1] for v in rows.values()]
        preds = [v[0] for v in rows.values()]
        t0 = time.perf_counter()
        m_rtn = whole_model(rtn, src, b)
        m_cal = whole_model(cal, src, b)
        t_verify = time.perf_counter() - t0
        line = {"format": fmt, "pred": statistics.mean(preds), "gain_a": statistics.mean(gains_a),
                "gain_b": statistics.mean(gains_b), "min_b": min(gains_b),
                "rtn": m_rtn, "cal": m_cal, "convert_s": t_conv, "rtn_s": t_rtn, "path": path}
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
    print("### summary per format (mean over the layers, each on the runtime path; whole model: "
          "verify --model --reference on the CPU, mean over held-out B)\n")
    print("| format | predicted gain | gain on A | gain on B | worst layer on B | video RTN | "
          "video calibrated | audio RTN | audio calibrated | convert RTN / calibrated (s) | "
          "path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['format']} | {s['pred']:+.1f} | {s['gain_a']:+.1f} | {s['gain_b']:+.1f} | "
              f"{s['min_b']:+.1f} | {s['rtn']['video']:.2f} | {s['cal']['video']:.2f} | "
              f"{s['rtn']['audio']:.2f} | {s['cal']['audio']:.2f} | "
              f"{s['rtn_s']:.1f} / {s['convert_s']:.1f} | {s['path']} |")
    if args.through:
        through_table(summary)
    if not args.few:
        sa.close()
        return
    few_table(src, a, d, src_w, sa, rows_b)


def through_table(summary) -> None:
    print("\n### whole model on the runtime path (verify --model --reference, CPU, mean over "
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


def few_table(src, a, d, src_w, sa, rows_b) -> None:
    # too few rows: one call (256 rows) for fc1 (K = 512), error feedback forced
    few = capture_statistics(src, a[:1], d / "few.stats", overwrite=True, predict=False)
    with Statistics(d / "few.stats") as sf:
        print(f"\n### too few rows ({few.rows} rows < K), W4A8, error feedback forced, held-out B "
              "(runtime path: int8 activations)\n")
        print("| layer | K | B: RTN | B: calibrated on too few rows | B: calibrated on A |")
        print("|---|---|---|---|---|")
        codec = registry.target_codec("w4a8")
        marker = codec.spec.planning.marker(registry.target("w4a8"), 256)
        for k in ("blocks.3.attn.qkv_proj", "blocks.3.mlp.fc1", "blocks.3.mlp.fc2"):
            lay = sf.layer(k)
            forced = LayerStats.from_hessian(k, lay.hessian(), 1 << 30)
            w = src_w[k]
            out_few = codec.encoder.encode(w, marker, "exact", calibration=forced)
            out_rtn = codec.encoder.encode(w, marker, "exact")
            out_a = codec.encoder.encode(w, marker, "exact", calibration=sa.layer(k))
            x = rows_b[k]
            ref = x @ w.t()
            vals = []
            for o in (out_rtn, out_few, out_a):
                with torch.no_grad():
                    y = runtime_layer(o, marker, compute_dtype=DTYPE)(x)
                err = float((y.double() - ref.double()).pow(2).sum())
                vals.append(10 * math.log10(float(ref.double().pow(2).sum()) / max(err, 1e-30)))
            print(f"| {k} | {lay.k} | {vals[0]:.1f} | {vals[1]:.1f} | {vals[2]:.1f} |")
    sa.close()


if __name__ == "__main__":
    main()
