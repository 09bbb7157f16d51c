"""``inspect``: what a checkpoint holds, from its headers alone.

No tensor data is read, except the tiny ``.comfy_quant`` marker tensors of layers the header
``_quantization_metadata`` does not describe (their byte count is reported as ``bytes_read``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

from h3quant.errors import ContainerError
from h3quant.findings import Severity
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.markers import (
    MARKER_SUFFIX,
)
from h3quant.formats.report import layer_report
from h3quant.pipelines.headers import naming as naming_view
from h3quant.pipelines.headers.layer_scan import MAX_MARKER_BYTES, MarkerReader, scan  # noqa: F401
from h3quant.pipelines.loaders import load_lines


def topology_summary(tensors, quantized: dict[str, str]) -> dict | None:
    """The detected H3 topology summary, or None when the checkpoint is not an H3 DiT."""
    try:
        from h3quant.h3 import topology
    except ModuleNotFoundError as exc:
        if exc.name == "h3quant.h3.topology":
            return None
        raise
    detection = topology.detect(tensors, quantized)
    return None if detection is None else topology.summary(detection, quantized)


@dataclass
class InspectResult:
    path: str
    index: str | None
    sharded: bool
    files: list[dict]  # {path, size}
    total_bytes: int
    tensor_count: int
    parameters: int  # logical weight elements (a quantized layer counts N*K)
    dtypes: dict[str, dict]  # dtype -> {tensors, bytes}
    formats: dict[str, dict]  # format or float dtype -> {layers, bytes}
    layer_counts: dict[str, int]  # {layers, quantized, other_tensors}
    bits_per_weight: dict[str, float | None]  # {all, quantized}
    topology: dict | None
    naming: dict  # {naming, evidence, fp8_scaled, error} (pipelines.headers.naming)
    metadata_keys: list[str]
    findings: dict[str, int]  # container + marker findings by severity (validate details them)
    notes: list[dict]  # the notes among them (info findings: what ComfyUI loads, H3 differs)
    bytes_read: int  # tensor-data bytes read (marker tensors only)
    layers: list[dict] | None  # one row per layer with layers=True
    mix: list[dict] | None = field(default=None)  # per-layer formats of a mixed file (see layer_mix)
    # will it load, and where does it run fast: one line per quantized format (device profiles)
    loads: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


INSPECT_KEYS = tuple(f.name for f in fields(InspectResult))
LAYER_KEYS = ("name", "format", "N", "K", "dtypes", "bits_per_weight", "source", "bytes",
              "layout", "nz")


_BLOCK = re.compile(r"^(?P<pre>.*?)blocks\.(?P<i>\d+)\.(?P<local>.+)$")


def layer_mix(layer_scan) -> list[dict] | None:
    """How the formats are mixed across layers, or None when every linear (2-D weight) has one
    format: one row per run of consecutive DiT blocks whose linears (those quantized in some
    block) have the same formats (``{"blocks": "0-1", "layers": {"attn.qkv_proj":
    "int8_tensorwise convrot g=256", ...}}``), then one row per other quantized layer
    (``{"layer": name, "format": ...}``)."""
    from h3quant.formats import registry

    desc: dict[str, str] = {}
    for name, lay in layer_scan.layers.items():
        w = lay.weight
        if w is None or (lay.fields is None and len(w.shape) != 2):
            continue
        try:
            desc[name] = registry.describe(lay.fields, w.dtype)
        except (KeyError, TypeError):
            continue
    if len(set(desc.values())) < 2:
        return None
    blocks: dict[int, dict[str, str]] = {}
    others = []
    quantized = {n for n, lay in layer_scan.layers.items() if lay.fields is not None}
    qlocal = {m.group("local") for n in quantized if (m := _BLOCK.match(n))}
    for name, d in desc.items():
        m = _BLOCK.match(name)
        if m and "token_refiner." not in m.group("pre"):
            if m.group("local") in qlocal:  # the linears quantized in some block
                blocks.setdefault(int(m.group("i")), {})[m.group("local")] = d
        elif name in quantized:
            others.append({"layer": name, "format": d})
    rows: list[dict] = []
    for i in sorted(blocks):
        sig = dict(sorted(blocks[i].items()))
        last = rows[-1] if rows else None
        if last is not None and last["layers"] == sig and last["_last"] == i - 1:
            last["_last"] = i
        else:
            rows.append({"_first": i, "_last": i, "layers": sig})
    out: list[dict] = [{"blocks": (f"{r['_first']}" if r["_first"] == r["_last"]
                                   else f"{r['_first']}-{r['_last']}"), "layers": r["layers"]}
                       for r in rows]
    used = {f for r in out for f in r["layers"].values()} | {r["format"] for r in others}
    return out + others if len(used) > 1 else None


def _bpw(nbytes: int, params: int) -> float | None:
    return round(8 * nbytes / params, 4) if params else None


def inspect_checkpoint(path: str | os.PathLike, *, mmap: bool = True, layers: bool = False,
                       read_data: bool = False) -> InspectResult:
    """Summarise a checkpoint from its headers.

    ``read_data=True`` reads every marker tensor even when the header metadata describes the
    layer (the same marker view ``validate`` takes); tensor data proper is never read.
    Container errors raise ``ContainerError`` (``validate`` lists them all).
    """
    with Checkpoint(path, mmap=mmap, strict=False) as ckpt:
        errors = [f for f in ckpt.findings if f.severity is Severity.ERROR]
        if errors or not ckpt.files:
            first = errors[0] if errors else None
            more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ContainerError(
                (first.message if first else "no readable file") + more
                + "; run `h3quant validate` for every finding",
                path=first.file if first else path, tensor=first.tensor if first else None,
                code=first.code if first else "C112")
        layer_scan, reader = scan(ckpt, prefer_header=not read_data)
        reports = [layer_report(lay) for lay in layer_scan.layers.values()]

        dtypes: dict[str, dict] = {}
        for info in ckpt.tensors.values():
            d = dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
            d["tensors"] += 1
            d["bytes"] += info.nbytes
        formats: dict[str, dict] = {}
        for rep in reports:
            if rep.format == "?":
                continue
            d = formats.setdefault(rep.format, {"layers": 0, "bytes": 0})
            d["layers"] += 1
            d["bytes"] += rep.nbytes

        data_bytes = sum(i.nbytes for n, i in ckpt.tensors.items() if not n.endswith(MARKER_SUFFIX))
        params = sum(r.params for r in reports)
        for lay in layer_scan.layers.values():
            params += lay.tensors["bias"].numel if "bias" in lay.tensors else 0
        params += sum(ckpt.tensors[n].numel for n in layer_scan.others)
        quant = [r for r in reports if r.quantized]
        quantized = {r.name: r.format for r in quant}
        # the findings validate reports without --deep (one verdict: the same rules, the same
        # count), so "N errors, run validate" always means validate's N
        from h3quant.pipelines.headers.validate import header_findings

        counts = {s.value: 0 for s in Severity}
        notes = []
        for f in header_findings(ckpt, (layer_scan, reader)):
            counts[f.level.value] += 1
            if f.level is Severity.INFO:
                notes.append({"code": f.code, "name": f.name, "tensor": f.tensor,
                              "message": f.message})

        return InspectResult(
            path=str(ckpt.path),
            index=str(ckpt.index_path) if ckpt.index_path else None,
            sharded=ckpt.is_sharded,
            files=[{"path": str(sf.path), "size": sf.file_size} for sf in ckpt.files],
            total_bytes=ckpt.total_bytes,
            tensor_count=len(ckpt.tensors),
            parameters=params,
            dtypes=dict(sorted(dtypes.items())),
            formats=dict(sorted(formats.items())),
            layer_counts={"layers": len(reports), "quantized": len(quant),
                          "other_tensors": len(layer_scan.others)},
            bits_per_weight={
                "all": _bpw(data_bytes, params),
                "quantized": _bpw(sum(r.weight_bytes for r in quant), sum(r.params for r in quant)),
            },
            topology=topology_summary(ckpt.tensors, quantized),
            naming=naming_view.summary(ckpt),
            metadata_keys=sorted(ckpt.metadata),
            findings=counts,
            notes=notes,
            bytes_read=reader.bytes_read,
            layers=[r.to_dict() for r in reports] if layers else None,
            mix=layer_mix(layer_scan),
            loads=load_lines(quantized.values()),
        )
