"""Verify a quantized H3 checkpoint numerically, per layer and per block, with reference-free data checks.

The quantized model (each linear on the runtime backend the device selects) is compared with a
float reference: the BF16 checkpoint given as ``reference``, else the checkpoint's own weights
dequantized to fp32, on seeded inputs identical on every device. The checks (layer, block, data)
and their default limits (``Thresholds``) are specified in docs/verify.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from h3quant.sources import open_as_comfy
from h3quant.errors import VerifyError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.formats import registry
from h3quant.pipelines.metrics import error_metrics
from h3quant.pipelines.verify import provenance
from h3quant.h3.provenance import SCALING_KEY, SMOOTHING_KEY
from h3quant.pipelines.verify.result import SqnrLimits, Verdict, by_encode
from h3quant.runtime.model.block import (
    FloatLinear,
    build_block,
    quantized_linear,
    reference_linear,
    swiglu,
)
from h3quant.runtime.loader import (
    BLOCK_LINEARS,
    LoadedBlock,
    LoadedLayer,
    block_indices,
    find_prefix,
    load_blocks,
)
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3quant.runtime.devices import Device

DEFAULT_BLOCKS = 2
DEFAULT_SIGMA = 0.6


_INT8_LIMITS = registry.class_limits(8)  # the 8-bit formats' limits
_W4A8_LIMITS = registry.class_limits(4)  # the 4-bit formats' (W4A8)


@dataclass(frozen=True)
class Thresholds:
    """Limits of ``verify``; the per-format defaults come from the codecs' ``verify`` limits
    (8-bit weight formats use the int8 ones, 4-bit the W4A8 ones)."""

    rel_err_int8: float = _INT8_LIMITS.rel_err
    rel_err_w4a8: float = _W4A8_LIMITS.rel_err
    block_sqnr_db_int8: float = _INT8_LIMITS.block_sqnr_db
    block_sqnr_db_w4a8: float = _W4A8_LIMITS.block_sqnr_db
    bad_row_fraction: float = 0.01
    w4a8_row_peak_min: int = 96
    saturation_fraction: float = 0.01
    magnitude_factor: float = 3.0

    def rel_err(self, fmt: str | None) -> float:
        own = registry.decoded_limits(fmt)  # a format run through its decode: its own limit
        if own is not None:
            return own.rel_err
        return self.rel_err_w4a8 if fmt is not None and registry.low_bit([fmt]) else self.rel_err_int8

    def block_limit(self, formats) -> float:
        return SqnrLimits(self.block_sqnr_db_int8, self.block_sqnr_db_w4a8).limit(formats)


@dataclass
class LayerCheck:
    name: str
    format: str
    path: str  # "plain" or "swiglu" (fused input activation)
    backend: str
    rel_err: float
    sqnr_db: float
    cosine: float
    limit: float
    passed: bool
    smoothed: bool = False  # stored as W diag(s) (convert --smooth): judged by its block
    expected_by: str | None = None  # the fresh encode whose figure set ``limit`` (None: fixed)


@dataclass
class BlockCheck:
    index: int
    formats: list[str]
    sqnr_db: float
    rel_err: float
    cosine: float
    limit_db: float
    passed: bool
    expected_by: str | None = None  # the fresh encode whose figure set ``limit_db`` (None: fixed)


@dataclass
class DataCheck:
    name: str
    check: str  # scales, row-range, saturation, magnitude
    value: float | None
    limit: str
    passed: bool
    detail: str = ""


@dataclass
class VerifyResult(Verdict):
    path: str
    reference: str  # the reference checkpoint, or "dequantized"
    device: str
    blocks: list[int]
    tokens: int
    seed: int
    thresholds: Thresholds
    layers: list[LayerCheck] = field(default_factory=list)
    block_checks: list[BlockCheck] = field(default_factory=list)
    data: list[DataCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, dict] = field(default_factory=dict)  # int8 layers judged as W4A8

    @property
    def failures(self) -> list[str]:
        out = [f"layer {c.name} [{c.path}]: rel err {c.rel_err:.4g} > {c.limit}"
               + by_encode(c.expected_by) for c in self.layers if not c.passed]
        out += [f"block {b.index}: SQNR {b.sqnr_db:.2f} dB < {b.limit_db} dB"
                + by_encode(b.expected_by) for b in self.block_checks if not b.passed]
        out += [f"{d.check} {d.name}: {d.detail}" for d in self.data if not d.passed]
        return out

    def to_dict(self) -> dict:
        """JSON-ready; non-finite numbers (a NaN error, an infinite SQNR) become strings."""
        return self.verdict_dict({
            "path": self.path, "reference": self.reference, "device": self.device,
            "blocks": self.blocks, "tokens": self.tokens, "seed": self.seed,
            "thresholds": asdict(self.thresholds),
            "layers": [asdict(c) for c in self.layers],
            "block_checks": [asdict(b) for b in self.block_checks],
            "data": [asdict(d) for d in self.data],
            "notes": self.notes, "provenance": self.provenance,
        })


# ------------------------------------------------------------------------------------ metrics


# ------------------------------------------------------------------------------ data checks


def _role(name: str) -> str | None:
    return next((r for r in BLOCK_LINEARS if name.endswith("." + r)), None)


SAMPLE_ROWS = 2048  # rows the magnitude heuristic reads per layer (evenly spaced)


def _sample(n: int) -> slice:
    return slice(None, None, max(1, -(-n // SAMPLE_ROWS)))


def _float_row_rms(ckpt: Checkpoint, name: str) -> float:
    """Row-norm RMS of a float weight, from up to SAMPLE_ROWS evenly spaced rows."""
    w = ckpt.read(name)
    rows = w[_sample(w.shape[0])].float()
    return math.sqrt(rows.pow(2).sum().item() / max(rows.shape[0], 1))


def _quant_row_rms(layer: LoadedLayer) -> float:
    """sqrt(mean_n s_n^2 |q_n|^2): the dequantized weight's row-norm RMS (H_g is orthogonal),
    from up to SAMPLE_ROWS evenly spaced rows."""
    q, s = layer.int8_grid()
    pick = _sample(q.shape[0])
    sq = q[pick].float().pow(2).sum(1).double()
    return math.sqrt((sq * s[pick].double().pow(2)).sum().item() / max(sq.shape[0], 1))


def float_siblings(ckpt: Checkpoint, scan, limit: int = 4) -> dict[str, float]:
    """Role -> median row-norm RMS of up to ``limit`` float 2-D linears of that role."""
    found: dict[str, list[float]] = {}
    for lname, layer in scan.layers.items():
        role = _role(lname)
        w = layer.weight
        if role is None or layer.fields is not None or w is None or len(w.shape) != 2 \
                or w.dtype not in ("BF16", "F16", "F32", "F64") or len(found.get(role, [])) >= limit:
            continue
        found.setdefault(role, []).append(_float_row_rms(ckpt, w.name))
    return {r: sorted(v)[len(v) // 2] for r, v in found.items()}


def _decoded_checks(layer: LoadedLayer, th: Thresholds, siblings: dict[str, float]
                    ) -> list[DataCheck]:
    """A layer run through its decode (fp8, mxfp8, ...): its codec's value rules (scales,
    codes) and the magnitude of its decoded rows against the float siblings."""
    name = layer.name
    found = layer.codec.checks.value_violations(layer.tensors) \
        if hasattr(layer.codec.checks, "value_violations") else []
    text = "; ".join(f"[{v.code}] {v.suffix}: {v.message}" for v in found)
    out = [DataCheck(name, "scales", None, "finite, > 0; codes finite", not found, text)]
    ref = siblings.get(_role(name) or "")
    if not th.magnitude_factor or ref is None:
        out.append(DataCheck(name, "magnitude", None, "no float sibling" if ref is None else
                             "disabled", True, "skipped"))
        return out
    w = layer.dequantize(torch.float32)
    rows = w[_sample(w.shape[0])]
    rms = math.sqrt(rows.pow(2).sum().item() / max(rows.shape[0], 1))
    ratio = rms / ref if ref > 0 else math.inf
    f = th.magnitude_factor
    ok = math.isfinite(ratio) and 1 / f <= ratio <= f
    out.append(DataCheck(name, "magnitude", ratio, f"ratio to float siblings in [1/{f:g}, "
                         f"{f:g}]", ok, "" if ok else f"decoded weights are {ratio:.3g}x the "
                         "float layers of the same role: scales look wrong"))
    return out


def data_checks(layer: LoadedLayer, th: Thresholds, siblings: dict[str, float]) -> list[DataCheck]:
    """The reference-free checks of one quantized layer (see the module docstring)."""
    if layer.decodes:
        return _decoded_checks(layer, th, siblings)
    name, out = layer.name, []
    q, s = layer.int8_grid()
    finite = bool(torch.isfinite(s).all()) and bool((s > 0).all())
    out.append(DataCheck(name, "scales", None, "finite, > 0", finite,
                         "" if finite else "a scale is zero, negative, NaN or inf"))
    if q.numel():  # per-row max and min in int8 (no widened copy of the codes)
        qmin = q.amin(1).to(torch.int32)
        peak = torch.maximum(q.amax(1).to(torch.int32), -qmin)
    else:
        qmin = peak = torch.zeros(0, dtype=torch.int32)
    rule = layer.codec.grid.row_range(layer.tensors, th)
    if rule.per_tensor:
        peak = peak.max().reshape(1) if peak.numel() else peak  # one scale: one peak per tensor
        qmin = qmin.min().reshape(1) if qmin.numel() else qmin
    bad, lim = rule.misses(peak, qmin), rule.text
    if rule.alt is not None and (bad & (peak > 0)).sum().item() > th.bad_row_fraction * max(bad.numel(), 1):
        alt = rule.alt.misses(peak, qmin)
        if not (alt & (peak > 0)).sum().item():  # every row fits the alternative grid
            bad, lim = alt, rule.alt.text
    bad &= peak > 0  # an all-zero row (a zero weight row) is legal
    rows = max(bad.numel(), 1)
    frac = bad.sum().item() / rows
    ok = frac <= th.bad_row_fraction
    out.append(DataCheck(name, "row-range", frac, f"{lim} (<= {th.bad_row_fraction:.0%} rows "
                         "miss)", ok, "" if ok else f"{bad.sum().item()} of {rows} rows miss "
                         f"(peaks {peak.min().item()}..{peak.max().item()}): codes do not match "
                         "their scales"))
    hist = torch.bincount(q.reshape(-1).view(torch.uint8), minlength=256)  # one pass
    at_max = int(hist[127] + hist[128] + hist[129])  # codes 127, -128, -127
    sat = (at_max - (peak >= 127).sum().item()) / max(q.numel(), 1)
    ok = sat <= th.saturation_fraction
    out.append(DataCheck(name, "saturation", sat, f"<= {th.saturation_fraction:.0%} codes at "
                         "|q| >= 127 beyond the row peak", ok,
                         "" if ok else f"{sat:.2%} of codes saturated: weights were clamped"))
    ref = siblings.get(_role(name) or "")
    if not th.magnitude_factor:
        out.append(DataCheck(name, "magnitude", None, "disabled", True, "skipped: disabled"))
    elif ref is None:
        out.append(DataCheck(name, "magnitude", None, "no float sibling", True,
                             "skipped: no float linear of the same role in the file"))
    else:
        ratio = _quant_row_rms(layer) / ref if ref > 0 else math.inf
        f = th.magnitude_factor
        ok = math.isfinite(ratio) and 1 / f <= ratio <= f
        out.append(DataCheck(name, "magnitude", ratio, f"ratio to float siblings in [1/{f:g}, "
                             f"{f:g}]", ok, "" if ok else f"dequantized weights are {ratio:.3g}x "
                             "the float layers of the same role: scales look wrong"))
    return out


# ---------------------------------------------------------------------------------- pipeline


def _layer_inputs(layer: LoadedLayer, tokens: int, seed: int, salt: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + salt)
    k = layer.in_features
    plain = torch.randn(tokens, k, generator=g)
    fused = torch.randn(tokens, 2 * k, generator=g) if layer.name.endswith("mlp.fc2") else None
    return plain, fused


class _SharedReference(torch.nn.Module):
    """A reference linear that also computes the layer checks' rows in the block's call, so each
    reference weight is streamed (converted chunk by chunk) once per block, not once per check."""

    def __init__(self, mod):
        super().__init__()
        self.mod, self.extra, self.results = mod, [], []

    def add(self, x: torch.Tensor, act: str | None) -> int:
        self.extra.append((x, act))
        return len(self.extra) - 1

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        parts = [swiglu(z) if act == "swiglu" else z
                 for z, act in [(x, input_act)] + self.extra]
        y = self.mod(torch.cat(parts) if len(parts) > 1 else parts[0])
        sizes = [z.shape[0] for z in parts]
        out = list(y.split(sizes))
        self.results = out[1:]
        return out[0]


def _check_layer(layer, run_mod, ref_out, inputs, tdev, dtype, th, judged=None,
                 smoothed: bool = False):
    """Layer checks from the reference outputs ``ref_out`` of the ``inputs`` (path, x), held to
    the limits of the format the layer is ``judged`` as (its own by default). A ``smoothed``
    layer (W diag(s), the division folded into the tensors before it) computes its float
    original only inside its block: its figures are shown, its block's check judges it."""
    limit = th.rel_err(judged or layer.format)
    checks = []
    for (path, x), ref in zip(inputs, ref_out):
        act = "swiglu" if path == "swiglu" else None
        with torch.no_grad():
            xd = x.to(dtype).to(tdev)
            y = (run_mod(xd, input_act=act) if act else run_mod(xd)).float().cpu()
        rel, sqnr, cos = error_metrics(y, ref)
        checks.append(LayerCheck(layer.name, layer.format.value, path,
                                 str(getattr(run_mod, "backend_name", "?")), rel, sqnr, cos, limit,
                                 smoothed or rel <= limit, smoothed))
    return checks


def _reference_linear(qblock: LoadedBlock, rblock: LoadedBlock | None, name: str):
    """The float reference module of one linear (stored float weights of the reference file,
    else the float math of the file's own codes); shapes checked against the file."""
    layer = qblock.linear(name)
    if rblock is None:
        return reference_linear(layer)
    ref = rblock.linear(name)
    if ref.is_quantized:
        raise VerifyError("the reference checkpoint must be a float checkpoint; this layer is "
                          f"quantized ({ref.fields['format'] if ref.fields else ref.format})", tensor=ref.name)
    if tuple(ref.weight.shape) != (layer.out_features, layer.in_features):
        raise VerifyError(f"reference weight is {list(ref.weight.shape)}, the checkpoint's layer is "
                          f"[{layer.out_features}, {layer.in_features}]", tensor=ref.name)
    return FloatLinear(ref.weight, ref.bias)


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    reference: str | os.PathLike | None = None,
    device: str | Device = "auto",
    blocks: int | list[int] | None = None,
    tokens: int = 64,
    seed: int = 0,
    sigma: float = DEFAULT_SIGMA,
    mmap: bool = True,
    thresholds: Thresholds | None = None,
    backend: str | None = None,
    probe=None,
    on_block=None,
    expected: bool = True,
    log=None,
) -> VerifyResult:
    """Run every check on ``blocks`` (an int: the first N blocks; a list: those indices; None: the
    first ``DEFAULT_BLOCKS``). ``backend`` forces one runtime backend; ``probe`` injects the facts
    about torch and the machine (see ``h3quant.runtime.capabilities``; simulations use it).
    With a ``reference`` and ``expected``, layers and blocks are held to a fresh plain encode of
    the reference in the file's formats, run the same way (``judge_relative``; ``log``: where
    its size goes). Raises VerifyError (or DeviceError) when the run cannot be set up."""
    from h3quant.runtime.availability import require_device

    th = thresholds or Thresholds()
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise VerifyError(f"tokens must be a positive integer, got {tokens!r}")
    if th.magnitude_factor and th.magnitude_factor < 1:
        raise VerifyError(f"magnitude_factor must be 0 (off) or >= 1, got {th.magnitude_factor}")
    dev = require_device(device, probe=probe)
    tdev = dev.torch_device
    dtype = dev.compute_dtype
    with Checkpoint(path, mmap=mmap) as ckpt:
        scan = scan_checkpoint(ckpt)
        idx = choose_blocks(blocks, block_indices(ckpt), path)
        if not _any_quantized(scan, ckpt, idx):
            raise VerifyError(f"blocks {idx} hold no quantized layer; nothing to verify", path=path)
        result = VerifyResult(str(path), str(reference) if reference else "dequantized",
                              str(dev), idx, tokens, seed, th)
        siblings = float_siblings(ckpt, scan)
        marks = provenance.header_set(ckpt)
        smoothed = provenance.header_set(ckpt, SMOOTHING_KEY)
        # the reference in any layout convert takes (official, diffusers, fp8), as ComfyUI's file
        rck = open_as_comfy(reference, mmap=mmap) if reference else None
        try:
            rscan = scan_checkpoint(rck) if rck is not None else None
            for i in idx:  # one block at a time: memory stays flat in the block count
                qb = load_blocks(ckpt, [i], scan=scan)[0]
                rb = load_blocks(rck, [i], scan=rscan)[0] if rck is not None else None
                _verify_block(qb, rb, result, (dev, tdev, dtype, backend, probe), siblings, ckpt,
                              sigma, marks, smoothed)
                del qb, rb
                if on_block is not None:  # progress: (blocks done, blocks in all)
                    on_block(idx.index(i) + 1, len(idx))
                _release(ckpt, f"{find_prefix(ckpt.tensors)}blocks.{i}.")
                if rck is not None:
                    _release(rck, f"{find_prefix(rck.tensors)}blocks.{i}.")
        finally:
            if rck is not None:
                rck.close()
        result.notes.extend(provenance.notes(result.provenance))
        scaled = provenance.scaled_layers(ckpt)
        if scaled and reference is not None:
            result.notes.append(
                f"{len(scaled)} layer(s) written with AWQ channel scaling (header "
                f"{SCALING_KEY}; the report gives each one's alpha, 0 where no scaling "
                "helped): out_proj / fc2 store W diag(s) and the v rows of qkv_proj / the up "
                "rows of fc1 hold the division, so each of them alone differs from its float "
                "layer by that scale; the pair computes what the float pair does: judge them by "
                "the block and whole-model (--model) figures")
        if any(c.smoothed for c in result.layers):
            n = len({c.name for c in result.layers if c.smoothed})
            result.notes.append(
                f"{n} layer(s) written with smoothing (header {SMOOTHING_KEY}): each stores "
                "W diag(s), and the tensors before it (the norm weight and adaLN shift rows, or "
                "the v / up rows) hold the division, so alone it differs from its float layer "
                "by that factor (its figures are shown, marked 'smoothed'); its block computes "
                "what the float block does, and the block check (and --model) judges it")
        if not siblings:
            result.notes.append("magnitude check skipped: the file has no float linear of a block "
                                "linear's role to compare scales with")
        if reference is None:
            result.notes.append("reference = the file's own dequantized weights: the layer and "
                                "block checks test the runtime; the data checks test the stored "
                                "codes; pass --reference to test weights against the original")
    if reference is not None and expected:
        judge_relative(result, path, reference, dict(
            device=dev, blocks=idx, tokens=tokens, seed=seed, sigma=sigma, mmap=mmap,
            thresholds=th, backend=backend, probe=probe), log=log)
    return result


def judge_relative(result: VerifyResult, path, reference, run: dict, log=None) -> None:
    """Hold each layer and block to the fresh plain encode of the reference in the file's
    formats (``pipelines.fresh_encode``) checked the same way, less the margin (layers: their
    relative error may exceed the encode's by that many dB). Where layers also have an encode
    in their stored dtype, each figure is the lower of the two encodes' (the larger error, the
    lower SQNR) and ``expected_by`` names the encode that gave it. Where nothing can be
    re-encoded the fixed limits stay (the note says what was compared)."""
    from h3quant.pipelines import fresh_encode as fe

    enc, runs = fe.judged_encode(str(path), str(reference), lambda p: verify_checkpoint(
        p, reference=reference, expected=False, **run), mmap=run["mmap"],
        log=log)
    if runs is None:
        result.notes.append(enc.describe())
        return
    layers = fe.lenient([(label, {(c.name, c.path): c.rel_err for c in exp.layers})
                         for label, exp in runs], higher_is_better=False)
    blocks = fe.lenient([(label, {b.index: b.sqnr_db for b in exp.block_checks})
                         for label, exp in runs])
    margin = enc.margin_db(fe.BLOCK_MARGIN_DB)
    factor = 10.0 ** (margin / 20.0)
    for c in result.layers:
        e, by = layers.get((c.name, c.path), (None, None))
        if e is None or c.smoothed or not math.isfinite(e) or c.name not in enc.encoded:
            continue
        c.limit = round(max(e * factor, 1e-6), 6)
        c.passed = c.rel_err <= c.limit  # NaN fails
        c.expected_by = by
    for b in result.block_checks:
        e, by = blocks.get(b.index, (None, None))
        if e is None or not math.isfinite(e):
            continue
        b.limit_db = round(e - margin, 2)
        b.passed = b.sqnr_db >= b.limit_db
        b.expected_by = by
    two = (f"; blocks held to the lower SQNR of the two encodes ({fe.set_by(blocks)}), layer "
           f"checks to the larger error ({fe.set_by(layers)})" if len(runs) > 1 else "")
    result.notes.append(f"limits: {enc.describe()}; each layer's relative error may exceed "
                        f"its own by {margin:g} dB, each block's SQNR fall "
                        f"{margin:g} dB below it (the fixed per-format limits do "
                        f"not apply){two}")


def _block_inputs(ckpt: Checkpoint, hidden: int, tokens: int, seed: int, sigma: float,
                  dtype: torch.dtype, compute: torch.dtype):
    """Seeded hidden states [tokens, hidden] and the real conditioning of a small t2va layout of
    ``tokens`` rows at ``sigma`` (the file's own time embedding and RoPE frequencies)."""
    from h3quant.runtime.model.layout import Timesteps, layout_for_rows
    from h3quant.runtime.model.model import load_time_embedding, make_conditioning, read_float

    prefix = find_prefix(ckpt.tensors)
    layout = layout_for_rows(tokens)
    cond = make_conditioning(layout, Timesteps.from_sigma(sigma),
                             load_time_embedding(ckpt, prefix),
                             read_float(ckpt, prefix + "rope.inv_freq"), compute, "cpu")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype).float(), cond


def _verify_block(qb, rb, result, run, siblings, ckpt, sigma, marks=frozenset(),
                  smoothed=frozenset()) -> None:
    dev, tdev, dtype, backend, probe = run
    th, seed, tokens = result.thresholds, result.seed, result.tokens
    refs, mods, inputs = {}, {}, {}
    for salt, name in enumerate(BLOCK_LINEARS):
        layer = qb.linear(name)
        refs[name] = _SharedReference(_reference_linear(qb, rb, name))
        mods[name] = quantized_linear(layer, device=dev, backend=backend, probe=probe,
                                      compute_dtype=dtype)
        if layer.is_quantized:
            plain, fused = _layer_inputs(layer, tokens, seed, qb.index * 16 + salt)
            # the reference sees the same (rounded) activations as the device
            inputs[name] = [(p, x.to(dtype).float()) for p, x in (("plain", plain),
                                                                  ("swiglu", fused))
                            if x is not None]
            for path, x in inputs[name]:
                refs[name].add(x, "swiglu" if path == "swiglu" else None)
    qblock = build_block(qb, lambda lay: mods[lay.name[len(qb.prefix) + 1:]], device=tdev)
    src = rb if rb is not None else qb
    rblock = build_block(src, lambda lay: refs[lay.name[len(src.prefix) + 1:]], device="cpu")
    # the reference runs fp32 throughout; the device in its activation dtype
    x, cond_ref = _block_inputs(ckpt, qblock.hidden, tokens, seed + qb.index, sigma, dtype,
                                torch.float32)
    _, cond = _block_inputs(ckpt, qblock.hidden, tokens, seed + qb.index, sigma, dtype, dtype)
    with torch.no_grad():
        y_ref = rblock(x, cond_ref)
        y = qblock(x.to(dtype).to(tdev), cond.to(tdev)).float().cpu()
    judged = []
    for name in BLOCK_LINEARS:
        layer = qb.linear(name)
        if layer.is_quantized:
            j = provenance.judge(layer, marks)
            judged.append(j)
            result.data.extend(data_checks(layer, th, siblings))
            result.layers.extend(_check_layer(layer, mods[name], refs[name].results,
                                              inputs[name], tdev, dtype, th, j.judged_as,
                                              smoothed=rb is not None and layer.name in smoothed))
    result.provenance.update(provenance.to_json(judged))
    rel, sqnr, cos = error_metrics(y - x, y_ref - x)
    fmts = sorted({lay.format.value for lay in qb.layers.values() if lay.is_quantized})
    limit = th.block_limit(provenance.judged_formats(judged, fmts))
    result.block_checks.append(BlockCheck(qb.index, fmts, sqnr, rel, cos, limit, sqnr >= limit))


def _any_quantized(scan, ckpt, idx) -> bool:
    from h3quant.runtime.loader import has_scaled_fp8_marker

    prefix = find_prefix(ckpt.tensors)
    heads = tuple(f"{prefix}blocks.{i}." for i in idx)
    scaled = has_scaled_fp8_marker(ckpt)  # legacy scaled-fp8 layers load as float8_e4m3fn
    return any(lay.fields is not None or (scaled and f"{n}.scale_weight" in ckpt.tensors)
               for n, lay in scan.layers.items() if n.startswith(heads))


def _release(ckpt: Checkpoint, stem: str) -> None:
    """Drop the mapped pages of a finished block (mmap mode; a no-op otherwise)."""
    for n in ckpt.tensors:
        if n.startswith(stem):
            ckpt.file_of(n).release_pages(ckpt.info(n))


def choose_blocks(blocks, have: list[int], path) -> list[int]:
    """The block indices to check: ``blocks`` (a count, or indices that must exist) or the first
    ``DEFAULT_BLOCKS``. A checkpoint without any block is refused."""
    if not have:
        raise VerifyError("no blocks.{i} tensors: not an H3 DiT checkpoint", path=path)
    if blocks is None:
        return have[:DEFAULT_BLOCKS]
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        if blocks < 1:
            raise VerifyError(f"--blocks must be >= 1, got {blocks}")
        return have[:blocks]
    idx = sorted({int(i) for i in blocks})
    missing = [i for i in idx if i not in have]
    if missing:
        raise VerifyError(f"no blocks {missing} in the checkpoint", path=path)
    return idx
