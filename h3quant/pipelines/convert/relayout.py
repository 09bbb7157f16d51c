"""Layer conversions that move stored codes instead of quantizing (FORMATS.md 9).

- ``relayout``: a format <-> its layout variant (the variant's spec names it ``canonical``) with
  the same ConvRot settings. The tensors the transposed side stores ``[K, N]`` (its
  ``transposed_outputs``) are transposed (in slabs of ``TRANSPOSE_BYTES``, never a second full
  copy), the per-row scale tensor (the spec's ``row_scale``) is copied as it is (``[N, 1]`` and
  ``[N]`` hold the same bytes; a single tensorwise scale is repeated N times for an ``[N]``
  form), nothing is requantized: canonical -> variant -> canonical gives back the canonical
  bytes.
- ``grid``: a format whose decoded weights lie on an int8 grid (its spec's ``grid_scale``) ->
  an int8 format (either layout) through that grid when the target's ConvRot group equals the
  source's, so a device without a kernel for the source runs exactly the same math.

``conversion_via`` decides, at plan time, which of these applies (else the layer is encoded);
every fact it uses is a spec's, found through the registry. Planning must not load torch
(``convert`` starts its copies first), so torch is imported on use.
"""

from __future__ import annotations

import functools

from h3quant.formats import registry
from h3quant.formats.transpose import TRANSPOSE_BYTES, RowTransposer, transpose_stream

COPY_CHUNK = 16 << 20


def _family(codec) -> str:
    return codec.spec.canonical or codec.spec.name


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
    if (src.spec.name != target_codec.spec.name and _family(src) == _family(target_codec)
            and src.spec.relayout.row_scale and target_codec.spec.relayout.row_scale
            and _same_rotation(src_fields, marker)):
        return "relayout"
    if (src.spec.relayout.grid_scale is not None and target_codec.spec.relayout.int8_codes
            and target_codec.spec.relayout.row_scale
            and _same_rotation({**src_fields, "convrot": src.spec.reading.uses_convrot(src_fields)}, marker)):
        return "grid"
    return "encode"


def describe_via(via: str, src_fields: dict | None, target_codec) -> str | None:
    """The plan's note for a layer converted ``via`` (None for an encoded layer)."""
    if via == "relayout":
        family = registry.spec(_family(target_codec))
        return family.relayout.relayout_note if family is not None else None
    if via == "grid" and src_fields is not None:
        src = registry.spec(src_fields["format"])
        return src.relayout.grid_note if src is not None else None
    return None


def _copy_bytes(reader, info, sink, out_name: str) -> None:
    for start, data in reader.chunks(info, COPY_CHUNK):
        sink.write(out_name, start, data)


def _write_scale(lp, reader, sink, info, n: int, suffix: str) -> None:
    out = f"{lp.name}.{suffix}"
    if info.numel == n:
        _copy_bytes(reader, info, sink, out)  # [N, 1] <-> [N]: the same bytes
    else:  # one tensorwise scale -> the kn form's [N]: the same value on every row
        import torch

        s = reader.whole(info).to(torch.float32).reshape(())
        sink.write_tensor(out, s.expand(n).contiguous())


def relayout_layer(lp, reader, sink, progress, codec) -> None:
    """Transpose a layer's codes to the target layout; copy its per-row scales."""
    src = registry.codec_for(lp.src_fields, tensor=lp.name).spec
    variant = codec.spec if codec.spec.storage.transposed_outputs else src  # the side stored [K, N]
    for suffix in variant.storage.transposed_outputs:
        w = lp.inputs[suffix]
        rows, cols = w.shape  # as stored: [N, K] (to the variant) or [K, N] (to canonical)
        transpose_stream(functools.partial(reader.rows, w), rows, cols,
                         functools.partial(sink.write, f"{lp.name}.{suffix}"),
                         release=functools.partial(reader.release_rows, w))
    scale = codec.spec.relayout.row_scale
    _write_scale(lp, reader, sink, lp.inputs[src.relayout.row_scale], lp.n, scale)
    sink.write(f"{lp.name}.comfy_quant", 0, lp.marker)
    progress(sum(t.nbytes for t in lp.inputs.values()))


def grid_layer(lp, reader, sink, progress, codec) -> None:
    """A format's codes on an int8 grid -> that grid, row slabs at a time, written in the
    target layout (its ``weight`` codes and ``row_scale`` scales)."""
    src = registry.codec_for(lp.src_fields, tensor=lp.name)
    spec, t, f = src.spec, lp.inputs, lp.src_fields
    n, k = lp.n, lp.k
    whole = {s: reader.whole(t[s]).clone() for s in spec.relayout.grid_whole if s in t}
    name = f"{lp.name}.weight"
    transposer = (RowTransposer(n, k, functools.partial(sink.write, name))
                  if "weight" in codec.spec.storage.transposed_outputs else None)
    step = max(1, TRANSPOSE_BYTES // max(k, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q = src.grid.grid_rows({s: reader.rows(t[s], r0, r1) for s in spec.relayout.grid_rows}, whole, f)
        if transposer is not None:
            transposer.add(q)
        else:
            sink.write_tensor(name, q, r0 * k)
        for s in spec.relayout.grid_rows:
            reader.release_rows(t[s], r0, r1)
    if transposer is not None:
        transposer.finish()
    _copy_bytes(reader, t[spec.relayout.grid_scale], sink, f"{lp.name}.{codec.spec.relayout.row_scale}")
    sink.write(f"{lp.name}.comfy_quant", 0, lp.marker)
    progress(sum(x.nbytes for x in t.values()))


def run_via(lp, reader, sink, progress, codec) -> None:
    if lp.via == "relayout":
        relayout_layer(lp, reader, sink, progress, codec)
    else:
        grid_layer(lp, reader, sink, progress, codec)
