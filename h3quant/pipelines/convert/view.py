"""The input as the conversion sees it: ComfyUI's single file (``sources.SourceView``), the
LoRAs baked in; a transformation (smoothing) folds into it."""

from __future__ import annotations

from typing import cast

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.pipelines.convert.options import ConvertOptions
from h3quant.sources import SourceView


def source_view(ckpt: Checkpoint, mapping, options: ConvertOptions):
    """(``ckpt`` seen as ComfyUI's single file, the LoRAs baked into it or None)."""
    view = SourceView(ckpt, mapping, options.codec.spec.quantized,
                            untouched_fp8(mapping, options) if options.codec.spec.quantized
                            else frozenset())
    loras = None
    if options.loras:  # read once, resolved against the logical ComfyUI shapes
        from h3quant.pipelines.convert import bake, lora

        quantized = bake.quantized_layers(view)
        loras = lora.load(options.loras, bake.logical_shapes(view, quantized),
                          options.lora_skip_unmatched)
        if view.kept & loras.layers:  # merged in float from the fp8 decode, then written BF16
            view.unkeep(loras.layers)
            quantized = bake.quantized_layers(view)
        bake.apply(view, loras, quantized)
    return cast(Checkpoint, view), loras


def untouched_fp8(mapping, options: ConvertOptions) -> frozenset[str]:
    """The fp8 weights this conversion copies rather than re-encodes (no preset, filter or
    rule picks their layer): kept as float8 layers (codes and scale unchanged) where their
    stored form allows, else shown as BF16 (rounded once, as ComfyUI computes with them);
    never widened to F32, so an fp8 -> int8 file is never larger than its BF16 equivalent."""
    from h3quant.pipelines.convert.options import is_h3, preset_selects, wide_rules

    from types import SimpleNamespace

    from h3quant.h3.naming import staged_entries

    headers = {n: SimpleNamespace(name=n, dtype=d, shape=s)
               for n, (d, s) in staged_entries(mapping, True).items()}
    preset = options.preset or ("h3" if is_h3(headers) else "all-linears")
    wide = wide_rules(options, preset, {n[: -len(".weight")]: h.shape for n, h in headers.items()
                                        if n.endswith(".weight")}) if options.layers else ()
    out = set()
    for t in mapping.targets:
        if not (t.fp8 and t.name.endswith(".weight")):
            continue
        layer = t.name[: -len(".weight")]
        rule, sub = options.for_layer(layer)
        if rule in wide and sub is not None:
            continue  # a rule picks it
        if preset_selects(preset, layer, "F32", 2, False) and options.filtered(layer):
            continue
        out.add(t.name)
    return frozenset(out)


__all__ = ["source_view", "untouched_fp8"]
