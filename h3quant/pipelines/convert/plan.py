"""Plan a conversion from the input header alone: every output tensor, shard and header.

Nothing here reads tensor data except the tiny ``.comfy_quant`` markers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3quant import __version__
from h3quant.errors import ConvertError, MarkerError
from h3quant.formats import registry
from h3quant.formats.container.atomic import check_output
from h3quant.formats.container.checkpoint import INDEX_SUFFIX, Checkpoint
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.h3 import provenance as origin
from h3quant.h3.topology import refuse_beyond_limit
from h3quant.sources.paths import input_paths
from h3quant.formats.layers import Layer, group_tensors
from h3quant.formats.markers import (
    HEADER_KEY,
    MARKER_SUFFIX,
    header_metadata_value,
    marker_bytes,
    parse_header_metadata,
)
from h3quant.formats.container.writer import Entry, Layout, plan_layout
from h3quant.pipelines.convert.layers import (
    NEVER_WRITTEN,
    CopyItem,
    LayerPlan,
    check_supported,
    empty_reason,
    logical_shape,
    resolve_marker,
    same_target,
    skip_reason,
)
from h3quant.pipelines.convert.folds import HEADER_KEY as FOLDS_KEY
from h3quant.pipelines.convert.folds import header_value as folds_header
from h3quant.pipelines.convert.folds import plan_folds
from h3quant.pipelines.convert.options import ConvertOptions, is_h3, preset_selects, wide_rules
from h3quant.pipelines.convert.recipe import check_rules
from h3quant.pipelines.convert.relayout import conversion_via, describe_via

DEFAULT_INDEX = "model" + INDEX_SUFFIX
PROVENANCE = ("h3quant.version", "h3quant.source", "h3quant.options")


@dataclass
class ShardPlan:
    name: str  # output file name (the input shard's name)
    metadata: dict[str, str]
    entries: list[Entry] = field(default_factory=list)
    layout: Layout | None = None  # set by build_plan once the entries are planned

    @property
    def planned_layout(self) -> Layout:
        """``layout``, which build_plan has set by the time a plan is read or run."""
        assert self.layout is not None, f"shard {self.name} has no layout yet"
        return self.layout


@dataclass
class ConvertPlan:
    src: Path
    dst: Path
    options: ConvertOptions
    preset: str
    h3: bool
    directory: bool  # the output is a directory of shards + index
    layers: list[LayerPlan]
    copies: list[CopyItem]  # plain tensors copied (layer copies live in LayerPlan.copies)
    shards: dict[str, ShardPlan]
    header_layers: dict[str, dict]
    repairs: list[str]
    dropped: list[str]
    identity: bool
    index_name: str | None
    index_metadata: dict
    input_bytes: int
    warnings: list[str] = field(default_factory=list)
    naming: dict | None = None  # a non-ComfyUI or fp8 input: its naming and name map (adopt)
    lora: dict | None = None  # baked LoRAs: files, strengths, the layers each touches
    rules: list = field(default_factory=list)  # convert.recipe.RuleUse per --layer/--recipe rule
    calibration: Any = None  # convert.calibrated.Calibration when --calibration is given
    folds: dict = field(default_factory=dict)  # convert.folds.Fold by consumer (AWQ scaling)
    precomputed: Any = None  # convert.onepass.BlockFiles: layers encoded block by block

    @property
    def output_bytes(self) -> int:
        return sum(s.planned_layout.file_bytes for s in self.shards.values())

    def layers_by(self, action: str) -> list[LayerPlan]:
        return [lay for lay in self.layers if lay.action == action]

    def all_copies(self) -> list[CopyItem]:
        return self.copies + [c for lay in self.layers for c in lay.copies]

    def to_dict(self) -> dict:
        copies = self.all_copies()
        return {
            "input": str(self.src), "output": str(self.dst), "target": self.options.target,
            "layout": self.options.layout,
            "preset": self.preset, "group_size": self.options.group_size, "h3": self.h3,
            "identity": self.identity,
            "counts": {a: len(self.layers_by(a)) for a in ("convert", "keep", "skip", "untouched")},
            "layers": [lay.to_dict() for lay in self.layers],
            "copied": {"tensors": len(copies), "bytes": sum(c.src.nbytes for c in copies)},
            "dropped": list(self.dropped), "repairs": list(self.repairs),
            "warnings": list(self.warnings),
            **({"rules": [u.to_dict() for u in self.rules]} if self.rules else {}),
            "files": [{"name": s.name, "bytes": s.planned_layout.file_bytes, "tensors": len(s.entries)}
                      for s in self.shards.values()],
            "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
            **({"naming": self.naming} if self.naming else {}),
            **({"lora": self.lora} if self.lora else {}),
            **({"awq_channel_scaling": {f.consumer: f.predecessor for f in self.folds.values()}}
               if self.folds else {}),
        }


def check_paths(ckpt: Checkpoint, src: Path, dst: Path, directory: bool, overwrite: bool,
                dry_run: bool = False) -> list[str]:
    """Refuse an output that is an input, not a regular file (or h3quant's own output
    directory), or exists without ``overwrite`` (see ``formats.container.atomic.check_output``).

    In a dry run an existing output is only noted (returned), since nothing will be written."""
    inputs = input_paths(ckpt, src)
    check_output(dst, directory=directory, overwrite=True, inputs=inputs)
    if os.path.lexists(dst) and not overwrite:
        if dry_run:
            return [f"{dst} exists: the real run needs --overwrite"]
        check_output(dst, directory=directory, overwrite=False, inputs=inputs)
    return []


def build_plan(ckpt: Checkpoint, src: Path, dst: Path, options: ConvertOptions,
               *, dry_run: bool = False) -> ConvertPlan:
    tensors = ckpt.tensors
    refuse_beyond_limit(tensors, ckpt.path)  # validate's T106: bounded work for any header
    h3 = is_h3(tensors)
    preset = options.preset or ("h3" if h3 else "all-linears")
    # a SourceView is ComfyUI's single file, whatever directory it is read from
    directory = ckpt.is_sharded or (src.is_dir() and not hasattr(ckpt, "input_files"))
    warnings = check_paths(ckpt, src, dst, directory, options.overwrite, dry_run)
    layers, others = group_tensors(tensors)
    repairs: list[str] = []
    header = None
    try:
        header = parse_header_metadata(ckpt.metadata)
    except MarkerError as exc:
        repairs.append(f"replaced unparseable {HEADER_KEY} ({exc.reason})")
    copies = [CopyItem(n, tensors[n], Entry(n, tensors[n].dtype, tensors[n].shape)) for n in others]
    plans: list[LayerPlan] = []
    dropped: list[str] = []
    candidates: list[str] = []  # layers a --layer / --recipe rule may decide
    wide = wide_rules(options, preset, {n: tuple(lay.weight.shape) for n, lay in layers.items()
                                        if lay.weight is not None}) if options.layers else ()
    for layer in layers.values():
        lp = _plan_layer(layer, header, ckpt.read_bytes, options, preset, candidates, wide,
                         getattr(ckpt, "dequantized", frozenset()))
        if lp is None:  # plain layer, not converted: copied as is
            copies += [CopyItem(t.name, t, Entry(t.name, t.dtype, t.shape))
                       for t in layer.tensors.values()]
            continue
        plans.append(lp)
        dropped += lp.dropped
        repairs += lp.repairs
    header_layers = {lp.name: lp.out_fields for lp in plans if lp.out_fields is not None}
    if header:
        gone = sorted(set(header) - set(layers))
        if gone:
            repairs.append(f"dropped {HEADER_KEY} entries for layers not in the file: "
                           + ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
    elif header is None and any(lp.action != "convert" and lp.out_fields for lp in plans) \
            and HEADER_KEY not in ckpt.metadata:
        repairs.append(f"added the missing {HEADER_KEY} (from the marker tensors)")
    identity = (not any(lp.action == "convert" or lp.produced for lp in plans) and not dropped
                and not repairs and getattr(ckpt, "lora", None) is None  # a LoRA changes weights
                and all(c.entry == Entry(c.src.name, c.src.dtype, c.src.shape)
                        for lp in plans for c in lp.copies))
    plan = ConvertPlan(src, dst, options, preset, h3, directory, plans, copies, {}, header_layers,
                       repairs, dropped, identity, None, dict(ckpt.index_metadata),
                       sum(t.nbytes for t in tensors.values()))
    plan.warnings = warnings
    if options.layers:
        plan.rules, overlaps = check_rules(options.layers, [p for p, _ in options._rules],
                                           candidates)
        plan.warnings += overlaps
    if not identity:
        plan.folds = plan_folds(plans, options)
    _plan_shards(plan, ckpt)
    return plan


def _plan_layer(layer: Layer, header, read_bytes, opts: ConvertOptions, preset: str,
                candidates: list[str] | None = None, wide=(), dequantized=frozenset()):
    """``dequantized``: weights a source reads as floats by dequantizing them (a GGUF file's
    quantized tensors): a dequantizing target (bf16) writes them in its own dtype."""
    res = resolve_marker(layer, header, read_bytes)
    w = layer.weight
    if w is None:
        return None  # a stray bias etc.: plain copy
    quantized = res.fields is not None
    rule, lopts = opts.for_layer(layer.name)  # a --layer / --recipe rule, or the --to options
    # a rule naming no layer the preset picks (``wide``) may name any linear the input has
    # (2-D float or quantized weight): `--layer 'token_refiner\.=bf16'`
    linear = quantized or (len(w.shape) == 2 and w.dtype in FLOAT_DTYPES)
    by_rule = False  # picked only because a rule names it (the preset leaves it alone)
    if lopts is None:  # keep: written as it is in the input
        selected = False
        lopts = opts
    elif not lopts.codec.spec.quantized:  # dequantizing: quantized layers, and named wider floats
        by_rule = not quantized and rule in wide and linear and w.dtype != "BF16"
        decoded = w.name in dequantized and len(w.shape) == 2 and w.dtype != "BF16"
        selected = opts.filtered(layer.name) and (quantized or by_rule or decoded)
    else:
        preset_pick = preset_selects(preset, layer.name, w.dtype, len(w.shape), quantized)
        by_rule = not preset_pick and rule in wide and linear
        selected = opts.filtered(layer.name) and (preset_pick or by_rule)
    if selected and by_rule and lopts.codec.spec.quantized and skip_reason(layer, res.fields, lopts):
        selected = False  # a broad rule meets a layer its format cannot take: left as it is
    if candidates is not None and opts.layers and opts.filtered(layer.name) and (
            quantized or preset_selects(preset, layer.name, w.dtype, len(w.shape), False)
            or (by_rule and selected)):
        candidates.append(layer.name)
    base, opts = opts, lopts
    if not selected and not quantized:
        return None
    shape = logical_shape(layer, res.fields)
    lp = LayerPlan(layer.name, "untouched", registry.describe(res.fields, w.dtype), None, shape,
                   src_fields=res.fields, inputs=dict(layer.tensors), repairs=list(res.repairs))
    if rule is not None:
        lp.options = opts
    if selected:
        check_supported(layer, res.fields)
        lp.reason = (skip_reason(layer, res.fields, opts) if opts.codec.spec.quantized
                     else empty_reason(layer))
        if lp.reason and rule is not None:  # a rule names a format this layer cannot take
            raise ConvertError(f"rule {rule + 1} {base.layers[rule].text!r}: layer "
                               f"{layer.name} cannot be written as {opts.target}: {lp.reason}")
        if lp.reason:
            lp.action = "skip"
        elif res.fields is not None and same_target(layer, res.fields, opts):  # quantized
            lp.action = "keep"
        else:
            lp.action = "convert"
    if lp.action == "convert":
        _plan_convert(lp, opts)
    else:
        _plan_verbatim(lp, res, opts if lp.action == "keep" else None)
    return lp


def _keep_fpmm(fields: dict | None, marker: dict) -> dict:
    if fields and fields.get("full_precision_matrix_mult") is True:
        marker = dict(marker, full_precision_matrix_mult=True)
    return marker


def _plan_convert(lp: LayerPlan, opts: ConvertOptions) -> None:
    n, k, name = lp.n, lp.k, lp.name
    codec = opts.codec
    marker = opts.marker()
    specs = codec.spec.planning.planned(n, k, marker)
    if marker is None:
        lp.target = codec.spec.reading.describe(None)
    else:
        lp.out_fields = _keep_fpmm(lp.src_fields, marker)
        lp.target = registry.describe(lp.out_fields)
        lp.marker = marker_bytes(lp.out_fields)
        specs["comfy_quant"] = ("U8", (len(lp.marker),))
    lp.produced = {f"{name}.{s}": Entry(f"{name}.{s}", d, sh) for s, (d, sh) in specs.items()}
    lp.via = conversion_via(lp.src_fields, codec, marker)
    note = describe_via(lp.via, lp.src_fields, codec)
    if note:
        lp.notes.append(note)
    for suffix, info in lp.inputs.items():
        if suffix == "bias":
            lp.copies.append(CopyItem(info.name, info, Entry(info.name, info.dtype, info.shape)))
        else:
            lp.dropped.append(info.name)


def _plan_verbatim(lp: LayerPlan, res, keep_opts: ConvertOptions | None) -> None:
    """keep / skip / untouched: tensors copied; ``keep`` normalises marker and header shapes."""
    name, n = lp.name, lp.n
    if keep_opts is not None:
        marker = keep_opts.marker()
        assert marker is not None  # "keep": same_target matched the target's marker
        lp.out_fields = _keep_fpmm(lp.src_fields, marker)
        lp.target = registry.describe(lp.out_fields)
    elif lp.src_fields is not None:
        lp.out_fields = res.raw
        lp.target = lp.source
        src = registry.spec(lp.src_fields["format"])
        if src is not None and src.encoding.kept_refusal:  # a read-only format is never copied out
            w = lp.inputs.get("weight")
            raise ConvertError(f"layer {name} would be copied as it is: {src.encoding.kept_refusal}",
                               path=getattr(w, "file", None), tensor=name, code="Q105")
        if src is not None and src.alias_of:  # written under the name it is read as
            lp.out_fields = dict(res.raw, format=src.alias_of)
            lp.target = registry.describe(dict(lp.src_fields, format=src.alias_of))
            lp.notes.append(f"marker renamed {src.name} -> {src.alias_of} (same tensors)")
    for suffix, info in lp.inputs.items():
        if suffix == "comfy_quant":
            continue
        if suffix in NEVER_WRITTEN:
            lp.dropped.append(info.name)
            lp.notes.append(f"dropped {suffix} (ComfyUI does not load it)")
            continue
        dtype, shape = info.dtype, tuple(info.shape)
        if keep_opts is not None:
            dtype, shape = keep_opts.codec.spec.planning.keep_declared(suffix, dtype, shape, n)
            if (dtype, shape) != (info.dtype, tuple(info.shape)):
                lp.notes.append(f"{suffix} re-declared {dtype} {list(shape)} "
                                f"(was {info.dtype} {list(info.shape)}; same bytes)")
        lp.copies.append(CopyItem(info.name, info, Entry(info.name, dtype, shape)))
    if lp.out_fields is None:
        return
    if res.tensor_raw is not None and res.tensor_raw == lp.out_fields:
        info = lp.inputs["comfy_quant"]
        lp.copies.append(CopyItem(info.name, info, Entry(info.name, info.dtype, info.shape)))
    else:
        lp.marker = marker_bytes(lp.out_fields)
        mname = name + MARKER_SUFFIX
        lp.produced[mname] = Entry(mname, "U8", (len(lp.marker),))
        if "comfy_quant" in lp.inputs:
            lp.dropped.append(mname)
        if res.tensor_raw is not None and keep_opts is not None:
            lp.notes.append(f"marker normalised to {lp.marker.decode()}")


def _provenance(plan: ConvertPlan, src_meta: dict[str, str]) -> dict[str, str]:
    """The provenance keys of an output file.

    A pure relayout (every converted layer only changed layout, nothing was quantized) keeps the
    input's provenance, with only the ``layout`` option changed: the codes are the ones that
    conversion made, and canonical -> npu -> canonical gives back the input's bytes."""
    converted = plan.layers_by("convert")
    if converted and all(lp.via == "relayout" for lp in converted):
        try:
            options = json.loads(src_meta.get("h3quant.options", ""))
        except json.JSONDecodeError:
            options = None
        if isinstance(options, dict) and all(k in src_meta for k in PROVENANCE):
            options.pop("layout", None)
            if plan.options.layout != "canonical":
                options["layout"] = plan.options.layout
            return {"h3quant.version": src_meta["h3quant.version"],
                    "h3quant.source": src_meta["h3quant.source"],
                    "h3quant.options": json.dumps(options, sort_keys=True)}
    return {"h3quant.version": __version__, "h3quant.source": plan.src.name,
            "h3quant.options": plan.options.provenance(plan.preset)}


def _from_w4a8(plan: ConvertPlan, ckpt: Checkpoint) -> set[str]:
    """The output layers converted from W4A8 (``h3quant.from_w4a8``, docs/FORMATS.md)."""
    before = set().union(*(origin.read(sf.metadata) for sf in ckpt.files))
    return {lp.name for lp in plan.layers
            if origin.carried(before, lp.name, lp.action, lp.via,
                              (lp.src_fields or {}).get("format"),
                              (lp.out_fields or {}).get("format"))}


def _plan_shards(plan: ConvertPlan, ckpt: Checkpoint) -> None:
    files = {sf.path.name: sf for sf in ckpt.files}
    shard_of = {}
    for c in plan.copies:
        shard_of[c.out] = (c.src.file.name, c.entry)
    for lp in plan.layers:
        home = lp.weight.file.name
        for c in lp.copies:
            shard_of[c.out] = (c.src.file.name, c.entry)
        for e in lp.produced.values():
            shard_of[e.name] = (home, e)
    from_w4a8 = _from_w4a8(plan, ckpt)
    for fname, sf in files.items():
        meta = dict(sf.metadata)
        if not plan.identity:
            meta.pop(HEADER_KEY, None)
            if plan.header_layers:
                meta[HEADER_KEY] = header_metadata_value(plan.header_layers)
            meta.update(_provenance(plan, sf.metadata))
            meta.pop(origin.KEY, None)
            if from_w4a8:
                meta[origin.KEY] = origin.value(from_w4a8)
            if plan.folds:
                meta[FOLDS_KEY] = folds_header(plan.folds, meta.get(FOLDS_KEY))
        plan.shards[fname] = ShardPlan(fname, meta)
    for home, entry in shard_of.values():
        plan.shards[home].entries.append(entry)
    for shard in plan.shards.values():
        shard.layout = plan_layout(shard.entries, shard.metadata)
    if plan.directory:
        plan.index_name = ckpt.index_path.name if ckpt.index_path else DEFAULT_INDEX
