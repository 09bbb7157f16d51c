"""Bake LoRAs into the weights ``convert`` reads (a ``SourceView``), before any encoding.

A float layer (BF16, F16, F32, or an fp8 weight decoded to F32 / BF16) is shown merged, in the
dtype it is shown in without the LoRA: the merge is summed in float64 and rounded once (see
``convert.lora``). A quantized layer (int8, W4A8, int8_kn) is decoded to fp32 through its codec,
merged, and shown as a plain F32 layer: its scales and marker are hidden and its entry leaves the
header's marker table, so the target encodes it again from the merged fp32 weight, exactly as it
would encode that fp32 weight from a file.

``native_target`` gives the ``--to`` options that re-encode a quantized input's layers in their
own format (what ``convert --lora`` does when ``--to`` is not given).
"""

from __future__ import annotations

from h3quant.errors import ConvertError, FormatError, MarkerError, UnsupportedError
from h3quant.formats import registry
from h3quant.formats.container.dtypes import FLOAT_DTYPES, to_torch
from h3quant.formats.layers import group_tensors
from h3quant.formats.markers import effective_fields, parse_header_metadata
from h3quant.pipelines.convert.layers import LayerPlan, logical_shape, resolve_marker

KEPT_SUFFIXES = ("weight", "bias")  # what a decoded layer keeps; its scales and marker go


def quantized_layers(view) -> dict:
    """Layer name -> (Layer, effective marker fields) of every quantized layer of ``view``."""
    try:
        header = parse_header_metadata(view.metadata)
    except MarkerError:
        header = None
    layers, _ = group_tensors(view.tensors)
    out = {}
    for name, layer in layers.items():
        try:
            res = resolve_marker(layer, header, view.read_bytes)
        except FormatError:
            continue  # convert's own plan reports the broken marker
        if res.fields is not None and layer.weight is not None:
            out[name] = (layer, res.fields)
    return out


def logical_shapes(view, quantized: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor, a quantized weight as its logical ``[N, K]``."""
    shapes = {n: tuple(i.shape) for n, i in view.tensors.items()}
    for name, (layer, fields) in quantized.items():
        shapes[f"{name}.weight"] = tuple(logical_shape(layer, fields))
    return shapes


def apply(view, loras, quantized: dict) -> None:
    """Show every layer ``loras`` touches merged (see the module text)."""
    for layer in sorted(loras.layers):
        wname = f"{layer}.weight"
        if layer in quantized:
            _decoded_layer(view, loras, layer, *quantized[layer])
            continue
        dtype = view.tensors[wname].dtype
        if dtype not in FLOAT_DTYPES:
            raise UnsupportedError(f"--lora: the weight is {dtype} without a quantization "
                                   "marker; h3quant cannot decode it to merge", tensor=wname)
        want = to_torch(dtype)

        def merged(layer=layer, wname=wname, want=want):
            return loras.merged(layer, view.exact(wname), want,  # fp8: from its fp32 decode
                                done=view.release_rows(wname))
        view.replace(wname, dtype, view.tensors[wname].shape, merged,
                     lambda wname=wname: view.stored(wname))
    view.lora = loras


def _decoded_layer(view, loras, layer: str, lay, fields: dict) -> None:
    import torch

    from h3quant.pipelines.convert.compute import SourceRows
    from h3quant.pipelines.convert.io import Reader

    inputs = {}
    for suffix, info in lay.tensors.items():
        target = view.source_name(info.name)
        if target is None:
            raise UnsupportedError(
                f"--lora: {layer} is stored quantized under a naming h3quant re-lays out; "
                "bake the LoRA into a ComfyUI-named file", tensor=info.name)
        inputs[suffix] = view.source.info(target)
    shape = tuple(logical_shape(lay, fields))
    lp = LayerPlan(layer, "convert", registry.describe(fields), None, shape,
                   src_fields=fields, inputs=inputs)

    def decode():
        return SourceRows(lp, Reader(view.source)).rows(0, shape[0]).to(torch.float32)

    def merged():
        return loras.merged(layer, decode(), torch.float32)
    hide = tuple(info.name for sfx, info in lay.tensors.items() if sfx not in KEPT_SUFFIXES)
    view.replace(f"{layer}.weight", "F32", shape, merged, decode, hide, unmark=layer)


def native_target(view) -> tuple[str, int, str] | None:
    """(``--to``, group size, layout) that writes the quantized layers of ``view`` in their own
    format; None when it has none. ``ConvertError`` when they use several formats."""
    quantized = quantized_layers(view)
    found = set()
    for name, (_, fields) in quantized.items():
        match = _target_of(fields)
        if match is None:
            raise ConvertError(f"{name} is stored as {registry.describe(fields)}, which no --to "
                               "target writes; choose --to")
        found.add(match)
    if len(found) > 1:
        raise ConvertError("the input's layers use several formats ("
                           + ", ".join(sorted(f"{t} g={g} layout={lay}" for t, g, lay in found))
                           + "); choose --to")
    return found.pop() if found else None


def _target_of(fields: dict) -> tuple[str, int, str] | None:
    want = effective_fields(fields)
    g = int(fields.get("convrot_groupsize", 256) or 256)
    for tname, target in registry.targets().items():
        base = registry.target_codec(tname)
        for layout in registry.layouts_of(base):
            codec = registry.with_layout(base, layout)
            marker = codec.spec.planning.marker(target, g) if codec is not None else None
            if marker is not None and effective_fields(marker) == want:
                return tname, g, layout
    return None
