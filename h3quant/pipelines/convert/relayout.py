"""Layer conversions that move int8 codes instead of quantizing (FORMATS.md 9).

- ``relayout``: int8_tensorwise <-> int8_tensorwise_kn with the same ConvRot settings. The codes
  are transposed (in slabs of ``TRANSPOSE_BYTES``, never a second full copy), the scale bytes are
  copied as they are (``F32 [N, 1]`` and ``[N]`` hold the same bytes; a single tensorwise scale
  is repeated N times for the kn form), nothing is requantized: canonical -> kn -> canonical
  gives back the canonical bytes.
- ``grid``: a format whose decoded weights lie on an int8 grid (its spec's ``grid_scale``:
  asym_w4a8_int8's ``w8`` codes with ``s = weight_s_channel``) -> int8 (either layout) through
  that grid when the target's ConvRot group equals the source's, so an NPU (which has no kernel
  for W4A8) runs exactly the same math.

``conversion_via`` decides, at plan time, which of these applies (else the layer is encoded).
Planning must not load torch (``convert`` starts its copies first), so torch is imported on use.
"""

from __future__ import annotations

import functools

from h3quant.formats import registry
from h3quant.formats.int8_kn.tensors import TRANSPOSE_BYTES, RowTransposer, transpose_stream

COPY_CHUNK = 16 << 20


def _family(codec) -> str:
    return codec.canonical or codec.name


def _same_rotation(src: dict, marker: dict) -> bool:
    convrot = bool(src.get("convrot"))
    return convrot == bool(marker.get("convrot")) and (
        not convrot or src.get("convrot_groupsize", 256) == marker.get("convrot_groupsize"))


def conversion_via(src_fields: dict | None, target_codec, marker: dict | None) -> str:
    """``relayout``, ``grid`` or ``encode`` for a layer stored with ``src_fields`` converted to
    ``target_codec`` writing ``marker``."""
    if src_fields is None or marker is None:
        return "encode"
    src = registry.get(src_fields["format"])
    if src is None:
        return "encode"
    if (src.name != target_codec.name and _family(src) == _family(target_codec)
            and _same_rotation(src_fields, marker)):
        return "relayout"
    if (src.spec.grid_scale is not None and target_codec.spec.int8_codes
            and _same_rotation({**src_fields, "convrot": src.spec.uses_convrot(src_fields)}, marker)):
        return "grid"
    return "encode"


def describe_via(via: str) -> str | None:
    if via == "relayout":
        return "pure relayout: same int8 codes and scales, transposed (no requantization)"
    if via == "grid":
        return "the decoded W4A8 int8 grid the runtime multiplies (codes w8, scale s_channel)"
    return None


def _copy_bytes(reader, info, sink, out_name: str) -> None:
    for start, data in reader.chunks(info, COPY_CHUNK):
        sink.write(out_name, start, data)


def _write_scale(lp, reader, sink, info, n: int) -> None:
    out = f"{lp.name}.weight_scale"
    if info.numel == n:
        _copy_bytes(reader, info, sink, out)  # [N, 1] <-> [N]: the same bytes
    else:  # one tensorwise scale -> the kn form's [N]: the same value on every row
        import torch

        s = reader.whole(info).to(torch.float32).reshape(())
        sink.write_tensor(out, s.expand(n).contiguous())


def relayout_layer(lp, reader, sink, progress) -> None:
    """Transpose an int8 layer's codes to the target layout; copy its scales."""
    w = lp.inputs["weight"]
    rows, cols = w.shape  # as stored: [N, K] (to kn) or [K, N] (to canonical)
    transpose_stream(lambda r0, r1: reader.rows(w, r0, r1), rows, cols,
                     functools.partial(sink.write, f"{lp.name}.weight"),
                     release=lambda r0, r1: reader.release_rows(w, r0, r1))
    _write_scale(lp, reader, sink, lp.inputs["weight_scale"], lp.n)
    sink.write(f"{lp.name}.comfy_quant", 0, lp.marker)
    progress(sum(t.nbytes for t in lp.inputs.values()))


def grid_layer(lp, reader, sink, progress, codec) -> None:
    """A format's codes on an int8 grid (W4A8's) -> that grid, row slabs at a time, written in
    the target layout."""
    src = registry.codec_for(lp.src_fields, tensor=lp.name)
    spec, t, f = src.spec, lp.inputs, lp.src_fields
    n, k = lp.n, lp.k
    whole = {s: reader.whole(t[s]).clone() for s in spec.grid_whole if s in t}
    name = f"{lp.name}.weight"
    transposer = (RowTransposer(n, k, functools.partial(sink.write, name))
                  if "weight" in codec.transposed_outputs else None)
    step = max(1, TRANSPOSE_BYTES // max(k, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q = src.grid_rows({s: reader.rows(t[s], r0, r1) for s in spec.grid_rows}, whole, f)
        if transposer is not None:
            transposer.add(q)
        else:
            sink.write_tensor(name, q, r0 * k)
        for s in spec.grid_rows:
            reader.release_rows(t[s], r0, r1)
    if transposer is not None:
        transposer.finish()
    _copy_bytes(reader, t[spec.grid_scale], sink, f"{lp.name}.weight_scale")
    sink.write(f"{lp.name}.comfy_quant", 0, lp.marker)
    progress(sum(x.nbytes for x in t.values()))


def run_via(lp, reader, sink, progress, codec) -> None:
    if lp.via == "relayout":
        relayout_layer(lp, reader, sink, progress)
    else:
        grid_layer(lp, reader, sink, progress, codec)
