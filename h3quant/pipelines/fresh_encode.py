"""The error a format is expected to have on this model: the reference encoded afresh, plainly
(round to nearest, no calibration), in the format a file stores each layer in.

``verify`` and ``compare`` judge a file against this encode, run on the same path and the same
inputs, instead of a fixed limit per format: a file within a margin of it (or better, as a
calibrated file is) is ok; one clearly worse is flagged (docs/verify.md, relative verdicts).

- safetensors files: each quantized layer of the file is re-encoded from the reference's float
  weight by its format's codec (the registry's; the codecs reproduce comfy-kitchen's
  quantizers), with the file's own marker fields (group sizes, ConvRot).
- GGUF files: each quantized tensor is re-encoded by the ``gguf`` package's own quantizer for
  its type and stored dequantized (the path GGUF layers run on). Types the package cannot
  quantize (the k-quants) are not re-encoded: the file is then judged by the fixed limits only,
  and the result says so.

The encode is written to a temporary safetensors file beside the caller's others. The reference's
other tensors are copied one at a time, but the re-encoded layers are held in memory until the
file is written, so a reference above ``MAX_REFERENCE_BYTES`` is not re-encoded (said).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h3quant.formats import registry

MAX_REFERENCE_BYTES = 8 << 30  # the encode is built in memory
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


@dataclass
class FreshEncode:
    """What was written: ``path`` (None when nothing could be re-encoded), the layers
    re-encoded, those that could not be (with why), and one line saying what is compared."""

    path: str | None
    encoded: dict[str, str] = field(default_factory=dict)  # layer -> format
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why not re-encoded

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


def file_layers(path: str) -> tuple[dict[str, dict], bool]:
    """(``{layer: effective marker fields}`` of the file's quantized layers, is it GGUF)."""
    from h3quant.formats.gguf.reader import is_gguf

    if is_gguf(path):
        return {n[:-len(".weight")]: {"gguf": q} for n, q in _gguf_layers(path).items()}, True
    from h3quant.formats.layers import scan_checkpoint
    from h3quant.sources import open_as_comfy

    from h3quant.h3 import provenance as origin

    with open_as_comfy(path) as ck:
        scan = scan_checkpoint(ck)
        from_w4a8 = set().union(*(origin.read(sf.metadata) for sf in ck.files))
        layers = {n: dict(lay.fields or {}) for n, lay in scan.quantized.items()}
    w4a8 = registry.spec(origin.W4A8)
    for n in from_w4a8 & set(layers):  # int8 converted from W4A8 carries W4A8's error
        if w4a8 is not None and w4a8.encoding.targets:
            rot = int(layers[n].get("convrot_groupsize", 256))
            layers[n] = dict(w4a8.planning.marker(w4a8.encoding.targets[0], rot) or {})  # ConvRot group as stored
    return layers, False


def judged_encode(file: str, reference: str, run_on, *, mmap: bool = True):
    """(the fresh encode of ``reference`` in ``file``'s formats, ``run_on(its path)``): the
    encode is written to a temporary folder, removed when ``run_on`` returns. The second item
    is None where nothing could be re-encoded (the first says why)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="h3quant-expected-") as work:
        enc = write_fresh_encode(file, reference, os.path.join(work, "fresh.safetensors"),
                                 mmap=mmap)
        if enc.path is None:
            return enc, None
        return enc, run_on(enc.path)


def write_fresh_encode(file: str, reference: str, out: str, *, mmap: bool = True,
                       scanned: tuple[dict[str, dict], bool] | None = None) -> FreshEncode:
    """Write to ``out`` the reference with every layer ``file`` quantizes re-encoded plainly in
    that layer's format (module docstring). The reference's other tensors are copied, one at a
    time, so only the re-encoded layers are held in memory while the file is written.
    ``scanned``: ``file_layers(file)`` where the caller has it already."""
    from h3quant.formats.container.writer import Entry, StreamingWriter, entry_for, plan_layout
    from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor
    from h3quant.sources import open_as_comfy

    layers, gguf = scanned if scanned is not None else file_layers(file)
    result = FreshEncode(None)
    with open_as_comfy(reference, mmap=mmap) as ref:
        if ref.total_bytes > MAX_REFERENCE_BYTES:
            result.skipped = {n: "the reference is too large to re-encode in memory"
                              for n in layers}
            return result
        ref_scan_quantized = _quantized_names(ref)
        names = set(ref.tensors)
        encoded: dict[str, object] = {}  # the re-encoded layers' tensors, held until written
        dropped: set[str] = set()  # reference weights the encode replaces
        header: dict[str, dict] = {}
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
            w = ref.read(wname).float()  # in float32, as convert encodes
            if gguf:
                got = _gguf_roundtrip(w, fields["gguf"])
                if got is None:
                    result.skipped[layer] = (f"the gguf package cannot quantize "
                                             f"{fields['gguf']}")
                    continue
                encoded[wname] = got
                dropped.add(wname)
                result.encoded[layer] = "gguf:" + fields["gguf"]
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
            dropped.add(wname)
            for suffix, value in codec.encode(w, fields, "exact").items():
                encoded[f"{layer}.{suffix}"] = value.contiguous()
            encoded[layer + ".comfy_quant"] = marker_tensor(fields)
            header[layer] = fields
            result.encoded[layer] = fields["format"]
            del w
        if not result.encoded:
            return result
        entries = [Entry(n, info.dtype, tuple(info.shape)) for n, info in ref.tensors.items()
                   if n not in dropped and n not in encoded]
        entries += [entry_for(n, t) for n, t in encoded.items()]  # type: ignore[arg-type]
        meta = {HEADER_KEY: header_metadata_value(header)} if header else None
        layout = plan_layout(entries, meta)
        with StreamingWriter(out, layout) as sink:
            for entry in layout.order:
                if entry.name in encoded:
                    sink.write_tensor(entry.name, encoded.pop(entry.name))  # type: ignore[arg-type]
                else:
                    sink.write_tensor(entry.name, ref.read(entry.name))
    result.path = out
    return result


def _quantized_names(ck) -> set[str]:
    from h3quant.formats.layers import scan_checkpoint

    return set(scan_checkpoint(ck).quantized)
