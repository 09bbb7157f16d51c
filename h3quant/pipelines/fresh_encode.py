"""The error a format is expected to have on this model: the reference encoded afresh, plainly
(round to nearest, no calibration), in the format a file stores each layer in.

``verify`` and ``compare`` judge a file against this encode, run on the same path and the same
inputs, instead of a fixed limit per format: a file within a margin of it (or better, as a
calibrated file is) is ok; one clearly worse is flagged (docs/verify.md, relative verdicts).

- safetensors files: each quantized layer of the file is re-encoded from the reference's float
  weight by its format's codec (the registry's; the codecs reproduce comfy-kitchen's
  quantizers from float32 weights), with the file's own marker fields (group sizes, ConvRot).
  Where comfy-kitchen quantizes weights in their stored dtype (int8 from bf16 / f16: the
  codec's ``encode_in_dtype``), that encode is made too and the layer is held to the worse of
  the two by its weight error (``FreshEncode.in_dtype``). int8 layers made from W4A8 (the
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
# ``encode_in_dtype`` is then encoded both ways and held to the worse (module docstring). Other
# formats kitchen makes from bf16 differ in a few scales only and stayed within the margin.
NATIVE_DTYPES = {"BF16": "bfloat16", "F16": "float16"}


@dataclass
class FreshEncode:
    """What was written: ``path`` (None when nothing could be re-encoded), the layers
    re-encoded, those that could not be (with why), and one line saying what is compared."""

    path: str | None
    encoded: dict[str, str] = field(default_factory=dict)  # layer -> format
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why not re-encoded
    # layer -> the stored dtype whose arithmetic (comfy-kitchen's from such weights) gave the
    # larger error, which the layer is held to
    in_dtype: dict[str, str] = field(default_factory=dict)
    as_w4a8: dict[str, str] = field(default_factory=dict)  # int8 layer -> why encoded as W4A8

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
            text += (f" ({len(self.in_dtype)} layers as comfy-kitchen encodes "
                     + "/".join(sorted(set(self.in_dtype.values())))
                     + " weights, in their dtype: the larger error)")
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


def judged_encode(file: str, reference: str, run_on, *, mmap: bool = True, log=None):
    """(the fresh encode of ``reference`` in ``file``'s formats, ``run_on(its path)``): the
    encode is written to a temporary folder (``TMPDIR``), removed however ``run_on`` ends (a
    SIGTERM included, which the CLI turns into an exception). The second item is None where
    nothing could be re-encoded (the first says why). ``log``: where the size goes."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="h3quant-expected-") as work:
        enc = write_fresh_encode(file, reference, os.path.join(work, "fresh.safetensors"),
                                 mmap=mmap, log=log)
        if enc.path is None:
            return enc, None
        return enc, run_on(enc.path)


@dataclass
class _Job:
    """One layer to re-encode: its name, the reference weight, how, and the tensors it makes."""

    layer: str
    wname: str
    fields: dict  # the marker fields, or {"gguf": type}
    entries: list  # the planned Entry of each tensor it writes
    gguf: bool = False
    in_dtype: str | None = None  # encoded as comfy-kitchen does in this stored dtype


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
        jobs.append(_Job(layer, wname, fields, entries))
    return jobs


def _encode(job: _Job, ref) -> dict:
    """``{tensor name: tensor}`` of one layer re-encoded (the reference weight in float32, as
    convert encodes)."""
    from h3quant.formats.markers import marker_tensor

    import torch

    raw = ref.read(job.wname)
    w = raw.float()
    if job.gguf:
        got = _gguf_roundtrip(w, job.fields["gguf"])
        if got is None:  # planned as quantizable: the package refused this weight
            raise ValueError(f"the gguf package could not quantize {job.wname}")
        return {job.wname: got}
    codec = registry.codec_for(job.fields, tensor=job.wname)
    made = codec.encoder.encode(w, job.fields, "exact")
    stored = ref.tensors[job.wname].dtype
    in_dtype = getattr(codec.encoder, "encode_in_dtype", None)
    if in_dtype is not None and stored in NATIVE_DTYPES:
        # comfy-kitchen quantizing the weight as stored works in its dtype: a valid file with
        # a larger error than the float32 encode's. Hold the layer to the worse of the two.
        other = in_dtype(raw.to(getattr(torch, NATIVE_DTYPES[stored])), job.fields)
        if _rel_err(codec, other, job.fields, w) > _rel_err(codec, made, job.fields, w):
            made = other
            job.in_dtype = stored
    out = {f"{job.layer}.{suffix}": value.contiguous() for suffix, value in made.items()}
    out[job.layer + ".comfy_quant"] = marker_tensor(job.fields)
    return out


def _rel_err(codec, made: dict, fields: dict, w) -> float:
    """``|W - decode(made)| / |W|`` (float32)."""
    import torch

    w_hat = codec.encoder.report_grid(made, fields)[0]
    return float(torch.linalg.vector_norm(w_hat - w) / torch.linalg.vector_norm(w).clamp(min=1e-30))


def write_fresh_encode(file: str, reference: str, out: str, *, mmap: bool = True,
                       scanned: tuple[dict[str, dict], bool, dict[str, str]] | None = None,
                       log=None) -> FreshEncode:
    """Write to ``out`` the reference with every layer ``file`` quantizes re-encoded plainly in
    that layer's format (module docstring). The file is planned from headers, then streamed:
    the reference's other tensors one at a time, then each layer encoded and written as it is
    made, so memory holds about one layer. Where ``out``'s folder has less free space than the
    file needs, nothing is written and the layers are marked skipped with the sizes (the fixed
    limits then apply). ``scanned``: ``file_layers(file)`` where the caller has it already;
    ``log``: where the planned size goes before the work starts."""
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
            log(f"writing the fresh encode of the reference ({size_text(need)}, {len(jobs)} layers "
                f"re-encoded) to the temporary folder {folder}; removed when done")
        with StreamingWriter(out, layout) as sink:
            for entry in kept:
                sink.write_tensor(entry.name, ref.read(entry.name))
            for job in jobs:
                tensors = _encode(job, ref)
                for entry in job.entries:
                    sink.write_tensor(entry.name, tensors.pop(entry.name))
                result.encoded[job.layer] = ("gguf:" + job.fields["gguf"] if job.gguf
                                             else job.fields["format"])
                if job.in_dtype:
                    result.in_dtype[job.layer] = job.in_dtype
    result.path = out
    return result


def _quantized_names(ck) -> set[str]:
    from h3quant.formats.layers import scan_checkpoint

    return set(scan_checkpoint(ck).quantized)
