"""The error a format is expected to have on this model: the reference encoded afresh, plainly
(round to nearest, no calibration), in the format a file stores each layer in.

``verify`` and ``compare`` judge a file against this encode, run on the same path and the same
inputs, instead of a fixed limit per format: a file within a margin of it (or better, as a
calibrated file is) is ok; one clearly worse is flagged (docs/verify.md, relative verdicts).

- safetensors files: each quantized layer of the file is re-encoded from the reference's float
  weight by its format's codec (the registry's; the codecs reproduce comfy-kitchen's
  quantizers from float32 weights), with the file's own marker fields (group sizes, ConvRot).
  Where comfy-kitchen quantizes weights in their stored dtype (int8 and fp8 from bf16 / f16:
  the codec's ``encode_in_dtype``), a second encode is made with those layers encoded that way
  (``FreshEncode.in_dtype``), and each layer, block and output is held to the lower of the two
  encodes' figures (``judged_encode``, ``lenient``): a larger weight error does not always give
  a lower block SQNR, so neither encode alone is the more lenient one. int8 layers made from W4A8 (the
  header's note, or their ConvRot rows on W4A8's grid: verify's provenance rule) are encoded as
  W4A8, the error they carry (``FreshEncode.as_w4a8``).
- GGUF files: each quantized tensor is re-encoded by the ``gguf`` package's own quantizer for
  its type and stored dequantized (the path GGUF layers run on). Types the package cannot
  quantize (the k-quants) are not re-encoded: the file is then judged by the fixed limits only,
  and the result says so.

The encode is a temporary safetensors file in ComfyUI's layout, planned from headers and streamed:
the reference's other tensors are copied one at a time and each layer is written as it is
re-encoded, so memory holds about one layer whatever the reference's size. Its size is said before
the work starts; where the temporary folder has less free space than that, nothing is written and
the file is judged by the fixed limits (said, with the size needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from h3quant.formats import registry

PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # names some GGUF files carry

# The margins (dB) below the fresh encode at which a file is flagged (docs/verify.md, relative
# verdicts; bench/bench_verdicts.py): kitchen's files whose encode this reproduces land at 0, an
# equally valid encoder that rounds differently (convert's fp8, its scale rounded to bf16) up to
# 3.4 dB below on a block, the closest planted defect (one nvfp4 scale x1.5) 6.6 dB below.
BLOCK_MARGIN_DB = 5.0  # one block's residual update, on the reference's own input
OUTPUT_MARGIN_DB = 5.0  # the model's video / audio output (one forward)
# Formats whose plain encode here is not comfy-kitchen's own: a file kitchen made lands further
# from it. W4A8: kitchen's files measured up to 6.1 dB below on a block, 8.9 dB on an output.
# (keyed by the wire name of the format --to w4a8 writes)
FORMAT_MARGIN_DB = {registry.target_codec("w4a8").spec.name: 12.0}
# Stored dtypes comfy-kitchen quantizes in (it does not upcast them): a format whose codec has
# ``encode_in_dtype`` (int8, fp8) is then encoded both ways, each figure held to the lower of the
# two (module docstring). The other formats kitchen makes from bf16 stayed within the margin of
# the float32 encode on the seeds measured (docs/verify.md).
NATIVE_DTYPES = {"BF16": "bfloat16", "F16": "float16"}
FLOAT32 = "float32"  # the label of the encode from float32 weights (the other: the stored dtype)


@dataclass
class FreshEncode:
    """What was written: ``path`` (None when nothing could be re-encoded), the layers
    re-encoded, those that could not be (with why), and one line saying what is compared."""

    path: str | None
    encoded: dict[str, str] = field(default_factory=dict)  # layer -> format
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why not re-encoded
    # layer -> its stored dtype, where comfy-kitchen's encode from such weights works in that
    # dtype: those layers are encoded that way too, in a second encode (``judged_encode``)
    in_dtype: dict[str, str] = field(default_factory=dict)
    as_w4a8: dict[str, str] = field(default_factory=dict)  # int8 layer -> why encoded as W4A8

    @property
    def labels(self) -> list[str]:
        """The encodes a file is judged against: float32's and, where layers have one, the
        stored dtype's (``judged_encode`` runs each)."""
        stored = "/".join(sorted(set(self.in_dtype.values())))
        return [FLOAT32, stored] if stored else [FLOAT32]

    @property
    def complete(self) -> bool:
        return self.path is not None and not self.skipped

    def margin_db(self, base: float) -> float:
        """The margin for this file: ``base``, or a wider one where a format's plain encode
        here is not comfy-kitchen's (``FORMAT_MARGIN_DB``)."""
        return max([base, *(FORMAT_MARGIN_DB.get(f, base) for f in self.encoded.values())])

    def describe(self) -> str:
        if self.path is None:
            why = sorted(set(self.skipped.values()))
            return ("no fresh encode of the reference in this file's format (" + "; ".join(why)
                    + "): judged by the fixed per-format limits only")
        kinds = sorted(set(self.encoded.values()))
        text = "the reference encoded afresh as " + ", ".join(kinds)
        w4a8 = sorted({why for n, why in self.as_w4a8.items() if n in self.encoded})
        if w4a8:
            text += (f" ({sum(n in self.encoded for n in self.as_w4a8)} int8 layers as W4A8, "
                     "the error they carry: " + "; ".join(w4a8) + ")")
        if self.in_dtype:
            text += (f" (and again with {len(self.in_dtype)} layers as comfy-kitchen encodes "
                     + "/".join(sorted(set(self.in_dtype.values())))
                     + " weights, in their dtype: each figure held to the lower of the two "
                     "encodes')")
        if self.skipped:
            text += (f" ({len(self.skipped)} layers not re-encoded: "
                     + "; ".join(sorted(set(self.skipped.values()))) + ")")
        return text


def _gguf_layers(path: str) -> dict[str, str]:
    """``{tensor name: GGUF type}`` of the file's quantized 2-D weights."""
    from h3quant.formats.gguf.reader import GgufFile

    with GgufFile(path) as g:
        return {n: t.qtype for n, t in g.tensors.items()
                if t.quantized and n.endswith(".weight") and len(t.shape) == 2}


def _gguf_roundtrip(w, qtype: str):
    """``w`` quantized and dequantized by the gguf package (None: it cannot quantize ``qtype``)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    try:
        kind = GGMLQuantizationType[qtype]
        raw = quants.quantize(w.float().numpy().astype(np.float32), kind)
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, kind))
                                .reshape(w.shape).astype(np.float32))
    except (KeyError, NotImplementedError, ValueError):
        return None


def _gguf_can_quantize(qtype: str) -> bool:
    """Whether the gguf package has a quantizer for ``qtype`` (the k-quants it has not)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        kind = GGMLQuantizationType[qtype]
        quants.quantize(np.zeros((1, GGML_QUANT_SIZES[kind][0]), np.float32), kind)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def file_layers(path: str) -> tuple[dict[str, dict], bool, dict[str, str]]:
    """(``{layer: effective marker fields}`` of the file's quantized layers, is it GGUF,
    ``{layer: why}`` of the int8 layers encoded as W4A8 instead). An int8 layer made from W4A8
    carries W4A8's error, so it is encoded as W4A8 when the header records it as converted from
    W4A8 or, without that note, when its ConvRot rows lie on W4A8's decoded grid (verify's
    provenance rule, docs/verify.md)."""
    from h3quant.formats.gguf.reader import is_gguf

    if is_gguf(path):
        return ({n[:-len(".weight")]: {"gguf": q} for n, q in _gguf_layers(path).items()},
                True, {})
    from h3quant.formats.layers import scan_checkpoint
    from h3quant.sources import open_as_comfy

    from h3quant.h3 import provenance as origin
    from h3quant.pipelines.verify import provenance as rule

    with open_as_comfy(path) as ck:
        scan = scan_checkpoint(ck)
        from_w4a8 = set().union(*(origin.read(sf.metadata) for sf in ck.files))
        layers = {n: dict(lay.fields or {}) for n, lay in scan.quantized.items()}
        why = {n: rule.REASON_HEADER for n in from_w4a8 & set(layers)}
        for n, f in layers.items():
            if n in why or not origin.is_int8(f.get("format")) or not f.get("convrot"):
                continue
            tensors = {s: ck.read(f"{n}.{s}") for s in ("weight", "weight_scale")}
            q, _ = registry.codec_for(f, tensor=n + ".weight").grid.int8_grid(tensors, f)  # [N, K]
            grid = rule.sampled_grid_origin(q)
            if grid is not None:
                why[n] = f"{rule.REASON_GRID} ({grid})"
    w4a8 = registry.spec(origin.W4A8)
    if w4a8 is None or not w4a8.encoding.targets:
        return layers, False, {}
    for n in why:  # int8 converted from W4A8 carries W4A8's error
        rot = int(layers[n].get("convrot_groupsize", 256))
        layers[n] = dict(w4a8.planning.marker(w4a8.encoding.targets[0], rot) or {})  # ConvRot group as stored
    return layers, False, why


def judged_encode(file: str, reference: str, run_on, *, mmap: bool = True, log=None,
                  scanned: tuple[dict[str, dict], bool, dict[str, str]] | None = None):
    """(the fresh encode of ``reference`` in ``file``'s formats, ``[(label, run_on(its
    path)), ...]``): the float32 encode's run and, where layers have an encode in their stored
    dtype (``FreshEncode.in_dtype``), that encode's run too; callers hold each figure to the
    lower of them (``lenient``). Each encode is written to a temporary folder (``TMPDIR``) and
    removed once run, so one exists at a time; the folder is removed however ``run_on`` ends (a
    SIGTERM included, which the CLI turns into an exception). The second item is None where
    nothing could be re-encoded (the first says why). ``log``: where the size goes;
    ``scanned``: ``file_layers(file)`` where the caller has it already."""
    import os
    import tempfile

    scanned = scanned if scanned is not None else file_layers(file)
    runs = []
    with tempfile.TemporaryDirectory(prefix="h3quant-expected-") as work:
        out = os.path.join(work, "fresh.safetensors")
        enc = write_fresh_encode(file, reference, out, mmap=mmap, scanned=scanned, log=log)
        for in_dtype in ((False, True) if enc.in_dtype else (False,)):
            made = enc if not in_dtype else write_fresh_encode(
                file, reference, out, mmap=mmap, scanned=scanned, log=log, in_dtype=True)
            if made.path is None:
                return made, None
            try:
                runs.append((made.labels[-1] if in_dtype else FLOAT32, run_on(made.path)))
            finally:  # one encode on disk at a time
                os.remove(made.path)
    return enc, runs


def lenient(runs: list[tuple[str, dict]], *, higher_is_better: bool = True) -> dict:
    """``{key: (figure, label)}``: each key's more lenient figure over the encodes' ``runs``
    (``[(label, {key: figure})]``): the lower SQNR (``higher_is_better``) or the larger error,
    and the label of the encode that gave it (the first on a tie). A finite figure wins over a
    non-finite one."""
    out: dict = {}
    for label, figures in runs:
        for key, v in figures.items():
            have = out.get(key)
            if have is None or (math.isfinite(v) and (not math.isfinite(have[0]) or (
                    v < have[0] if higher_is_better else v > have[0]))):
                out[key] = (v, label)
    return out


def set_by(picked: dict) -> str:
    """Which encode set the figures ``lenient`` picked: ``"float32 encode: 2, BF16 encode: 1"``
    (counts per label)."""
    counts: dict[str, int] = {}
    for _, label in picked.values():
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} encode: {n}" for label, n in counts.items())


@dataclass
class _Job:
    """One layer to re-encode: its name, the reference weight, how, and the tensors it makes."""

    layer: str
    wname: str
    fields: dict  # the marker fields, or {"gguf": type}
    entries: list  # the planned Entry of each tensor it writes
    gguf: bool = False
    in_dtype: str | None = None  # also encoded as comfy-kitchen does in this stored dtype


def _plan_jobs(ref, layers: dict[str, dict], gguf: bool, result: FreshEncode) -> list[_Job]:
    """The layers that can be re-encoded, each with the tensors it will write (names, dtypes
    and shapes from the format's own plan, before any weight is read); the others go to
    ``result.skipped`` with why."""
    from h3quant.formats.container.writer import Entry
    from h3quant.formats.markers import marker_bytes

    ref_scan_quantized = _quantized_names(ref)
    names = set(ref.tensors)
    jobs = []
    for layer, fields in sorted(layers.items()):
        if layer + ".weight" not in names:  # a GGUF file's names under ComfyUI's prefix
            for prefix in PREFIXES:
                if layer.startswith(prefix) and layer[len(prefix):] + ".weight" in names:
                    layer = layer[len(prefix):]
                    break
        wname = layer + ".weight"
        if wname not in names or layer in ref_scan_quantized:
            result.skipped[layer] = ("the reference has no float weight of that name"
                                     if wname not in names else
                                     "the reference stores it quantized")
            continue
        shape = tuple(ref.tensors[wname].shape)
        if gguf:
            if not _gguf_can_quantize(fields["gguf"]):
                result.skipped[layer] = f"the gguf package cannot quantize {fields['gguf']}"
                continue
            jobs.append(_Job(layer, wname, fields, [Entry(wname, "F32", shape)], gguf=True))
            continue
        codec = registry.codec_for(fields, tensor=wname)
        if codec.spec.canonical and codec.spec.canonical != fields.get("format"):
            # a layout variant (the NPU's [K, N] int8) has its canonical format's error:
            # encode that one, which the runtime runs with the same arithmetic
            fields = {**fields, "format": codec.spec.canonical}
            codec = registry.codec_for(fields, tensor=wname)
        if codec.spec.encoding.write_refusal:
            result.skipped[layer] = f"{fields['format']}: {codec.spec.encoding.write_refusal}"
            continue
        planned = codec.spec.planning.planned(shape[0], shape[1], fields)
        entries = [Entry(f"{layer}.{s}", d, tuple(sh)) for s, (d, sh) in planned.items()]
        entries.append(Entry(layer + ".comfy_quant", "U8", (len(marker_bytes(fields)),)))
        stored = ref.tensors[wname].dtype
        in_dtype = stored if (getattr(codec.encoder, "encode_in_dtype", None) is not None
                              and stored in NATIVE_DTYPES) else None
        jobs.append(_Job(layer, wname, fields, entries, in_dtype=in_dtype))
    return jobs


def _encode(job: _Job, ref, in_dtype: bool = False) -> dict:
    """``{tensor name: tensor}`` of one layer re-encoded: from the reference weight in float32,
    as convert encodes, or with ``in_dtype`` where the layer has one (``job.in_dtype``) as
    comfy-kitchen encodes it in its stored dtype (a valid file whose error differs)."""
    from h3quant.formats.markers import marker_tensor

    import torch

    raw = ref.read(job.wname)
    if job.gguf:
        got = _gguf_roundtrip(raw.float(), job.fields["gguf"])
        if got is None:  # planned as quantizable: the package refused this weight
            raise ValueError(f"the gguf package could not quantize {job.wname}")
        return {job.wname: got}
    codec = registry.codec_for(job.fields, tensor=job.wname)
    if in_dtype and job.in_dtype:
        encode_in_dtype = getattr(codec.encoder, "encode_in_dtype")
        made = encode_in_dtype(raw.to(getattr(torch, NATIVE_DTYPES[job.in_dtype])), job.fields)
    else:
        made = codec.encoder.encode(raw.float(), job.fields, "exact")
    out = {f"{job.layer}.{suffix}": value.contiguous() for suffix, value in made.items()}
    out[job.layer + ".comfy_quant"] = marker_tensor(job.fields)
    return out


def write_fresh_encode(file: str, reference: str, out: str, *, mmap: bool = True,
                       scanned: tuple[dict[str, dict], bool, dict[str, str]] | None = None,
                       log=None, in_dtype: bool = False) -> FreshEncode:
    """Write to ``out`` the reference with every layer ``file`` quantizes re-encoded plainly in
    that layer's format (module docstring). The file is planned from headers, then streamed:
    the reference's other tensors one at a time, then each layer encoded and written as it is
    made, so memory holds about one layer. Where ``out``'s folder has less free space than the
    file needs, nothing is written and the layers are marked skipped with the sizes (the fixed
    limits then apply). ``scanned``: ``file_layers(file)`` where the caller has it already;
    ``log``: where the planned size goes before the work starts; ``in_dtype``: the layers that
    have one (``FreshEncode.in_dtype``) encoded as comfy-kitchen does in their stored dtype,
    the others as without it."""
    import os
    import shutil

    from h3quant.formats.container.writer import Entry, StreamingWriter, plan_layout
    from h3quant.sizes import size_text
    from h3quant.formats.markers import HEADER_KEY, header_metadata_value
    from h3quant.sources import open_as_comfy

    layers, gguf, as_w4a8 = scanned if scanned is not None else file_layers(file)
    result = FreshEncode(None, as_w4a8=dict(as_w4a8))
    with open_as_comfy(reference, mmap=mmap) as ref:
        jobs = _plan_jobs(ref, layers, gguf, result)
        if not jobs:
            return result
        result.in_dtype = {job.layer: job.in_dtype for job in jobs if job.in_dtype}
        made = [e for job in jobs for e in job.entries]
        replaced = {job.wname for job in jobs} | {e.name for e in made}
        kept = [Entry(n, info.dtype, tuple(info.shape)) for n, info in ref.tensors.items()
                if n not in replaced]
        header = {job.layer: job.fields for job in jobs if not job.gguf}
        meta = {HEADER_KEY: header_metadata_value(header)} if header else None
        layout = plan_layout(kept + made, meta, keep_order=True)  # one layer's group at a time
        folder = os.path.dirname(os.path.abspath(out))
        need, free = layout.file_bytes, shutil.disk_usage(folder).free
        if free < need:
            why = (f"the temporary folder {folder} has {size_text(free)} free and the fresh encode "
                   f"needs {size_text(need)} (set TMPDIR to a folder with more space)")
            result.skipped.update({job.layer: why for job in jobs})
            return result
        if log is not None:
            how = (f", {len(result.in_dtype)} of them as comfy-kitchen encodes "
                   f"{'/'.join(sorted(set(result.in_dtype.values())))} weights"
                   if in_dtype else "")
            log(f"writing the fresh encode of the reference ({size_text(need)}, {len(jobs)} layers "
                f"re-encoded{how}) to the temporary folder {folder}; removed when done")
        with StreamingWriter(out, layout) as sink:
            for entry in kept:
                sink.write_tensor(entry.name, ref.read(entry.name))
            for job in jobs:
                tensors = _encode(job, ref, in_dtype)
                for entry in job.entries:
                    sink.write_tensor(entry.name, tensors.pop(entry.name))
                result.encoded[job.layer] = ("gguf:" + job.fields["gguf"] if job.gguf
                                             else job.fields["format"])
    result.path = out
    return result


def _quantized_names(ck) -> set[str]:
    from h3quant.formats.layers import scan_checkpoint

    return set(scan_checkpoint(ck).quantized)
