"""How much the whole model's output degrades when one block (or one linear) is quantized.

One pass over the blocks of a float H3 checkpoint, with the real streamed forward
(``runtime.model.H3Model``, fp32 on the CPU) on seeded inputs (the same ones ``verify --model``
uses). At block ``j`` the float block is loaded once and, for each candidate format, its
linears are encoded with that format's codec (the bytes ``convert`` would write) and run on
the runtime's int8 path. Streams:

* the float reference runs block ``j`` in float;
* for each candidate (unit ``u`` in block ``j``, format ``f``) a new stream starts: the float
  hidden state goes through block ``j`` with ``u`` in ``f`` (the rest of the block float);
* every stream started at an earlier block runs block ``j`` in float.

With statistics (``calibration``, from ``h3quant capture``), every candidate whose format has a
calibrated encoder is encoded as ``convert --calibration`` would write it (the same scales,
codes by error feedback; layers convert rounds to nearest, too few rows, are rounded to nearest
here too) and labelled ``FORMAT+gptq``, and every candidate runs on the runtime's default CPU
path for its format (``runtime.model.block.quantized_linear``, what ``verify --model`` runs:
INT4 ConvRot with int4 activations, W4A8 and int8 with int8 activations, nvfp4 decoded).
With ``smooth`` as well (``convert --smooth auto``), each candidate that smoothing applies to
is labelled ``FORMAT+gptq+smooth``: at block ``j`` the factors ``convert`` would choose for
each of the block's linears with that format as its target (``convert.smoothing.layer_choice``,
the same search) are folded into the block's float tensors, the statistics are divided by them,
and only then are the linears encoded; the folded float block computes what the original does
(powers of two), so the rest of the model and the reference are unchanged.

After the last block each stream's video and audio outputs are compared with the reference's:
the noise energy each (unit, format) alone puts on each output. Memory holds one block's weights
(plus its encoded copies) and one hidden state per stream; compute is one float block forward
per stream per later block (blocks x candidates x blocks / 2 forwards in all).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, field

from h3quant.errors import H3QuantError, VerifyError

OUTPUTS = ("video", "audio")
DEFAULT_FORMATS = ("int8-convrot", "w4a8")
CALIBRATED = "+gptq"  # label suffix of a candidate measured with calibrated codes
SMOOTHED = "+smooth"  # ... and smoothed as convert --smooth auto smooths (after CALIBRATED)


class PlanError(H3QuantError):
    """The plan cannot be made (bad candidates, a quantized input, an unreachable target)."""

    exit_code = 2


@dataclass(frozen=True)
class Candidate:
    """A format a unit may take: a ``convert --to`` target, its group size, and whether its
    codes are chosen with calibration statistics (``convert --calibration``)."""

    target: str
    group_size: int = 256
    calibrated: bool = False
    smoothed: bool = False  # with calibrated: folded as convert --smooth auto folds
    linear_dtype: str | None = None  # INT4 ConvRot's linear=int8: int8 activations on GPUs

    @property
    def format(self) -> str:
        opts = ([f"g={self.group_size}"] if self.group_size != 256 else []) + (
            [f"linear={self.linear_dtype}"] if self.linear_dtype else [])
        base = self.target + (":" + ",".join(opts) if opts else "")
        return base + (CALIBRATED if self.calibrated else "") + (SMOOTHED if self.smoothed
                                                                 else "")

    def marker(self) -> dict:
        """The marker ``convert`` writes for this candidate."""
        from h3quant.formats import registry

        codec = registry.target_codec(self.target)
        marker = codec.spec.planning.marker(registry.target(self.target), self.group_size)
        assert marker is not None  # candidates are quantized formats
        if self.linear_dtype:
            marker = codec.spec.planning.with_linear_dtype(marker, self.linear_dtype) or marker
        return marker


def split_calibrated(fmt: str) -> tuple[str, bool]:
    """``w4a8:g=64+gptq`` (or ``+gptq+smooth``) -> (``w4a8:g=64``, True): the convert format
    and the calibration."""
    if fmt.endswith(SMOOTHED):
        fmt = fmt[:-len(SMOOTHED)]
    if fmt.endswith(CALIBRATED):
        return fmt[:-len(CALIBRATED)], True
    return fmt, False


def is_smoothed(fmt: str) -> bool:
    """Whether a candidate label was measured smoothed (``+gptq+smooth``)."""
    return fmt.endswith(CALIBRATED + SMOOTHED)


def _items(text: str) -> list[str]:
    """The comma-separated candidates of ``text``; an item that is a format option
    (``int4-convrot:g=64,linear=int8``) continues the one before it."""
    items: list[str] = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        key = part.partition("=")[0]
        if items and ":" in items[-1] and "=" in part and ":" not in part and "-" not in key:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def parse_candidates(text: str) -> tuple[Candidate, ...]:
    """``int8-convrot,w4a8,int8-convrot:g=64,w4a8+gptq`` -> candidates (PlanError on a bad
    one; ``+gptq``: calibrated codes, for formats with a calibrated encoder)."""
    from h3quant.errors import ConvertError
    from h3quant.formats import registry
    from h3quant.pipelines.convert.recipe import parse_format

    out = []
    for item in _items(text):
        base, calibrated = split_calibrated(item)
        smoothed = is_smoothed(item)
        if item.endswith(SMOOTHED) and not smoothed:
            raise PlanError(f"--formats: {item!r}: smoothing is measured with calibrated "
                            "codes only (FORMAT+gptq+smooth)")
        try:
            target, opts = parse_format(base, "--formats")
        except ConvertError as exc:
            raise PlanError(exc.reason) from None
        if target is None or target == "bf16":
            raise PlanError(f"--formats: {item!r} is not a quantized format (float is always "
                            "the unquantized choice)")
        if opts.get("layout", "canonical") != "canonical":
            raise PlanError("--formats: the planner measures the canonical layout only")
        if calibrated and not registry.target_codec(target).spec.encoding.calibrates:
            raise PlanError(f"--formats: {target} has no calibrated encoder ({item!r})")
        if smoothed and not _smoothable(target):
            raise PlanError(f"--formats: {target} is not smoothed ({item!r})")
        linear = opts.get("linear_dtype")
        if linear is not None and registry.target_codec(target).spec.planning.with_linear_dtype(
                {}, linear) is None:
            raise PlanError(f"--formats: {target} has no activation choice ({item!r}: linear= "
                            "applies to int4-convrot)")
        cand = Candidate(target, opts.get("group_size") or 256, calibrated, smoothed,
                         None if linear == "int4" else linear)
        if cand in out:
            raise PlanError(f"--formats: {item!r} is given twice")
        out.append(cand)
    if not out:
        raise PlanError("--formats: no format given")
    return tuple(out)


@dataclass
class UnitResult:
    """One unit (a block or a linear) in one format, the rest of the model float."""

    unit: str  # "blocks.3" or "blocks.3.mlp.fc1"
    block: int
    format: str
    bytes: int  # the unit's bytes in this format (weights, scales, markers; biases aside)
    float_bytes: int  # the unit's bytes as stored in the float input
    noise: dict[str, float]  # output -> ||y_u,f - y||^2
    sqnr_db: dict[str, float]  # output -> whole-model SQNR with only this unit quantized

    @property
    def min_sqnr_db(self) -> float:
        return min(self.sqnr_db.values())


@dataclass
class Sensitivity:
    path: str
    inputs: dict
    formats: list[str]
    per_layer: bool
    blocks: int
    prefix: str
    signal: dict[str, float]  # output -> ||y||^2 of the float reference
    units: list[UnitResult] = field(default_factory=list)
    seconds: float = 0.0
    seconds_per_block: list[float] = field(default_factory=list)
    # what it was measured on (pipelines.fingerprint): a saved pass is refused for other files
    measured_on: dict = field(default_factory=dict)

    def unit_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for u in self.units:
            seen.setdefault(u.unit, None)
        return list(seen)

    def table(self) -> dict[str, dict[str, UnitResult]]:
        """unit -> format -> result."""
        out: dict[str, dict[str, UnitResult]] = {}
        for u in self.units:
            out.setdefault(u.unit, {})[u.format] = u
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["units"] = [asdict(u) for u in self.units]
        return d

    @classmethod
    def from_dict(cls, d) -> "Sensitivity":
        """A saved pass, every field checked before use (``PlanError`` naming the field)."""
        from h3quant.pipelines.plan.saved import checked_pass

        kw = checked_pass(d, parse_candidates)
        kw["units"] = [UnitResult(**u) for u in kw["units"]]
        return cls(**kw)


def sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _smoothable(target: str) -> bool:
    from h3quant.formats import registry
    from h3quant.pipelines.convert.smoothing import eligible

    codec = registry.target_codec(target)
    return codec.spec.encoding.calibrates and eligible(codec)


def with_calibration(cands, calibrated: bool, smooth: bool = False) -> tuple[Candidate, ...]:
    """With statistics, every candidate whose format calibrates is measured calibrated (and,
    with ``smooth``, smoothed where convert --smooth auto smooths it; ``PlanError`` if that
    names one twice); without, a ``+gptq`` candidate is refused, and without ``smooth`` a
    ``+smooth`` one."""
    from h3quant.formats import registry

    if not calibrated:
        bad = [c.format for c in cands if c.calibrated]
        if bad:
            raise PlanError(f"--formats {bad[0]}: calibrated candidates need --calibration "
                            "STATS (h3quant capture)")
        if smooth:
            raise PlanError("--smooth auto needs --calibration STATS (the factors are chosen "
                            "from its statistics)")
        return tuple(cands)
    bad = [c.format for c in cands if c.smoothed and not smooth]
    if bad:
        raise PlanError(f"--formats {bad[0]}: smoothed candidates need --smooth auto")
    out: list[Candidate] = []
    for c in cands:
        cal = registry.target_codec(c.target).spec.encoding.calibrates
        c = Candidate(c.target, c.group_size, cal, smooth and _smoothable(c.target),
                      c.linear_dtype)
        if c in out:
            raise PlanError(f"--formats: {c.format} is given twice (with --calibration every "
                            "format that calibrates is measured calibrated)")
        out.append(c)
    return tuple(out)


def _encoded_layer(layer, cand: Candidate, calibration=None):
    """The LoadedLayer ``convert`` would write for a float ``layer`` in ``cand``'s format
    (``calibration``: convert's per-layer statistics, used for a calibrated candidate)."""
    from h3quant.formats import registry
    from h3quant.formats.markers import effective_fields
    from h3quant.runtime.loader import LoadedLayer

    codec = registry.target_codec(cand.target)
    marker = cand.marker()
    k = int(layer.weight.shape[1])
    why = codec.spec.planning.skip_reason(k, marker)
    if why:
        raise PlanError(f"{layer.name} cannot be written as {cand.format}: {why}")
    st = None
    if cand.calibrated and calibration is not None:
        # convert's own per-layer decision (no statistics, too few rows: rounded to nearest)
        st, _ = calibration.for_layer(layer.name, k, codec, marker)
    if st is not None:
        tensors = dict(codec.encoder.encode(layer.weight, marker, "exact", calibration=st))
        st.release()
    else:
        tensors = dict(codec.encoder.encode(layer.weight, marker, "exact"))
    if layer.bias is not None:
        tensors["bias"] = layer.bias
    return LoadedLayer(layer.name, tensors, effective_fields(marker), "plan")


def _candidate_linear(layer, device, compute_dtype, runtime: bool = False):
    """The module a candidate-format layer runs as: the runtime's quantized linear where the
    runtime multiplies the format's int8 grid (int8, W4A8), else the float linear of the
    format's decoded weight (nvfp4, INT4 ConvRot: the dequantizing path, weight error only).
    ``runtime``: always the runtime's default module for the format (INT4 ConvRot with its
    int4 activations), what ``verify --model`` runs; a layer whose marker asks for int8
    activations (INT4 ConvRot ``linear=int8``) runs as GPUs run it (``paths.on_kernel_route``:
    its marker changes nothing on the CPU path)."""
    import torch

    from h3quant.runtime.model.block import FloatLinear, quantized_linear
    from h3quant.runtime.paths import A8_ROUTE, on_kernel_route

    codec = layer.codec
    if runtime or not codec.spec.runtime.decodes:
        mod = quantized_linear(layer, device=device, compute_dtype=compute_dtype)
        if (layer.fields or {}).get("linear_dtype") == "int8":
            mod = on_kernel_route(mod, A8_ROUTE)
        return mod
    rows, whole = codec.decoder.source_tensors(layer.fields, layer.tensors)
    whole_t = {s: layer.tensors[s] for s in whole}
    local = {s: layer.tensors[s] for s in rows}
    local.update(codec.decoder.row_views(whole_t, layer.fields))
    w = codec.decoder.decode_rows(local, whole_t, layer.fields)
    return FloatLinear(w.to(torch.bfloat16), layer.bias)  # cast in chunks per call


def unit_bytes(n: int, k: int, cand: Candidate | None, float_bytes: int) -> int:
    """Bytes of an [n, k] linear's weight tensors in ``cand`` (None: as stored in float), with
    its marker tensor; from the codec's planned tensor set, as convert lays them out."""
    if cand is None:
        return float_bytes
    from h3quant.formats import registry
    from h3quant.formats.container.dtypes import itemsize
    from h3quant.formats.markers import marker_bytes

    codec = registry.target_codec(cand.target)
    marker = cand.marker()
    total = len(marker_bytes(marker))
    for dtype, shape in codec.spec.planning.planned(n, k, marker).values():
        total += math.prod(shape) * itemsize(dtype)
    return total


def measure(path: str | os.PathLike, *, formats=DEFAULT_FORMATS, per_layer: bool = False,
            inputs=None, mmap: bool = True, blocks: int | None = None,
            on_block=None, calibration: str | os.PathLike | None = None,
            smooth: bool = False) -> Sensitivity:
    """The sensitivity pass (see the module docstring). ``formats``: Candidates or their text;
    ``blocks``: measure only the first N blocks (the model then ends after them; for quick
    looks); ``on_block(done, total)`` after each block; ``calibration``: a statistics file
    of this checkpoint (candidates that calibrate are measured calibrated, ``+gptq``);
    ``smooth``: and smoothed as ``convert --smooth auto`` does (``+gptq+smooth``)."""
    from h3quant.pipelines.verify.model import ModelInputs

    cands = tuple(c if isinstance(c, Candidate) else parse_candidates(c)[0] for c in formats)
    cands = with_calibration(cands, calibration is not None, smooth)
    inputs = inputs or ModelInputs()
    calib = None
    if calibration is not None:
        from h3quant.pipelines.convert.calibrated import Calibration

        calib = Calibration(str(calibration), path)
    try:
        return _measure(path, cands, per_layer, inputs, mmap, blocks, on_block, calib)
    finally:
        if calib is not None:
            calib.close()


def statistics_identity(path: str | os.PathLike) -> dict:
    """What a saved pass records of the statistics it was measured with: the file name and
    the checksum of its header (which holds the checkpoint's checksum and every input's
    sha256)."""
    from h3quant.calibration.fingerprint import checkpoint_fingerprint

    return {"file": os.path.basename(str(path)),
            "header_sha256": checkpoint_fingerprint(path)}


def _measure(path, cands, per_layer, inputs, mmap, blocks, on_block, calib) -> Sensitivity:
    import torch

    from h3quant.h3.topology import BLOCK_LINEARS
    from h3quant.runtime.loader import load_prefix
    from h3quant.runtime.model.block import build_block, reference_linear
    from h3quant.runtime.model.model import H3Model

    t0 = time.perf_counter()
    with H3Model.open(path, "cpu", mmap=mmap, linear="reference", any_layout=True) as model:
        quantized = [n for n, lay in model.scan.layers.items() if lay.fields is not None
                     and n.startswith(model.prefix + "blocks.")]
        if quantized:
            fields = model.scan.layers[quantized[0]].fields or {}
            raise PlanError(f"plan measures a float checkpoint; {quantized[0]} is quantized "
                            f"({fields['format']}): plan from "
                            "the BF16 original")
        run = model.blocks[:blocks] if blocks else model.blocks
        video, audio, text = inputs.tensors(model.video_channels, model.audio_channels,
                                            model.text_dim)
        ref = model.start(video, audio, text, inputs.sigma)
        from h3quant.pipelines.fingerprint import checkpoint_fingerprint, inputs_fingerprint

        result = Sensitivity(str(path), asdict(inputs), [c.format for c in cands], per_layer,
                             len(run), model.prefix, {})
        result.measured_on = {"checkpoint": checkpoint_fingerprint(path, mmap=mmap),
                              "inputs": inputs_fingerprint(asdict(inputs))}
        if calib is not None:
            result.measured_on["statistics"] = statistics_identity(calib.stats.path)
        streams: list[tuple[int, torch.Tensor]] = []  # (unit index, hidden state)
        meta: list[tuple[str, int, Candidate, int, int]] = []  # unit, block, cand, bytes, float
        cpu = model.device
        for done, i in enumerate(run):
            tb = time.perf_counter()
            prefix = f"{model.prefix}blocks.{i}"
            loaded = load_prefix(model.ckpt, model.scan, prefix, i)
            fblock = build_block(loaded, lambda lay: reference_linear(lay, device=model.tdev),
                                 device=model.tdev)
            with torch.no_grad():
                for n, (u, x) in enumerate(streams):
                    streams[n] = (u, fblock(x, ref.cond))
                groups = [[lin] for lin in BLOCK_LINEARS] if per_layer else [list(BLOCK_LINEARS)]
                for cand in cands:
                    folded, cal = loaded, calib
                    if cand.smoothed:  # folded as convert --smooth auto folds this target
                        folded, factors = _smoothed_block(loaded, cand, calib, model.ckpt)
                        cal = calib.smoothed_by(factors)
                    enc = {lin: _encoded_layer(folded.linear(lin), cand, cal)
                           for lin in BLOCK_LINEARS}
                    for group in groups:
                        def make(lay, _g=group, _enc=enc):
                            local = lay.name[len(prefix) + 1:]
                            if local in _g:
                                return _candidate_linear(_enc[local], cpu, torch.float32,
                                                         runtime=calib is not None)
                            return reference_linear(lay, device=model.tdev)

                        qblock = build_block(folded, make, device=model.tdev)
                        unit = prefix if not per_layer else f"{prefix}.{group[0]}"
                        nbytes = fbytes = 0
                        for lin in group:
                            w = model.ckpt.tensors[f"{prefix}.{lin}.weight"]
                            nn_, kk = (int(d) for d in w.shape)
                            fbytes += w.nbytes
                            nbytes += unit_bytes(nn_, kk, cand, w.nbytes)
                        meta.append((unit[len(model.prefix):], i, cand, nbytes, fbytes))
                        streams.append((len(meta) - 1, qblock(ref.x, ref.cond)))
                        del qblock
                    del enc, folded, cal
                ref.x = fblock(ref.x, ref.cond)
            del fblock, loaded
            model.release_block(i)
            result.seconds_per_block.append(time.perf_counter() - tb)
            if on_block is not None:
                on_block(done + 1, len(run))
        want = dict(zip(OUTPUTS, model.finish(ref)))
        result.signal = {o: float(want[o].double().pow(2).sum()) for o in OUTPUTS}
        for u, x in streams:
            ref.x = x
            got = dict(zip(OUTPUTS, model.finish(ref)))
            noise = {o: float((got[o].double() - want[o].double()).pow(2).sum()) for o in OUTPUTS}
            unit, block, cand, nbytes, fbytes = meta[u]
            result.units.append(UnitResult(unit, block, cand.format, nbytes, fbytes, noise,
                                           {o: sqnr_db(result.signal[o], noise[o])
                                            for o in OUTPUTS}))
    result.seconds = time.perf_counter() - t0
    return result


def _smoothed_block(loaded, cand: Candidate, calib, ckpt):
    """(``loaded`` with the smoothing ``convert --smooth auto`` chooses for ``cand``'s format
    folded into its float tensors, layer name -> ``s`` of the smoothed linears). Each linear's
    factors come from ``convert.smoothing.layer_choice`` on the stored weight, as convert's
    search reads it (before any fold)."""
    from dataclasses import replace

    from h3quant.calibration import smooth
    from h3quant.formats import registry
    from h3quant.pipelines.convert.smoothing import FLOATS, layer_choice, touched

    codec = registry.target_codec(cand.target)
    marker = cand.marker()
    prefix = loaded.prefix + "."
    factors_of: dict = {}
    found: dict = {}
    for lin in smooth.SMOOTHED:
        name = prefix + lin
        if any(t not in ckpt.tensors or ckpt.tensors[t].dtype not in FLOATS
               for t in touched(prefix, lin)):
            continue
        st = calib.stats.layer(name)
        if st is None:
            continue
        choice = layer_choice(name, loaded.linear(lin).weight,
                              ckpt.tensors[f"{name}.weight"].dtype, st, codec, marker)
        st.release()
        if choice is not None and choice.s is not None:
            factors_of[lin], found[name] = choice.s, choice.s
    if not factors_of:
        return loaded, found
    flat = {f"{local}.{suffix}": t for local, lay in loaded.layers.items()
            for suffix, t in lay.tensors.items()}
    changed = smooth.fold_block(flat, factors_of)
    layers = {}
    for local, lay in loaded.layers.items():
        tensors = {suffix: changed.get(f"{local}.{suffix}", t) for suffix, t in lay.tensors.items()}
        hit = any(f"{local}.{suffix}" in changed for suffix in lay.tensors)
        layers[local] = replace(lay, tensors=tensors, _grid=None) if hit else lay
    return replace(loaded, layers=layers), found


def unit_pattern(prefix: str, unit: str) -> str:
    """The recipe pattern naming exactly ``unit`` (a block's linears, or one linear)."""
    return "^" + re.escape(prefix + unit) + (r"\." if unit.count(".") == 1 else "$")


__all__ = ["CALIBRATED", "SMOOTHED", "Candidate", "PlanError", "Sensitivity", "UnitResult", "VerifyError",
           "is_smoothed", "measure", "parse_candidates", "split_calibrated", "sqnr_db", "statistics_identity",
           "unit_bytes", "unit_pattern", "with_calibration"]
