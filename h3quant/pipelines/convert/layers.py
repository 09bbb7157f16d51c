"""Per-layer planning for ``convert``: which marker counts, whether the tensors fit it, and what
each layer becomes (from the input header and the tiny marker tensors alone)."""

from __future__ import annotations

from dataclasses import dataclass, field

from h3quant.errors import FormatError, MarkerError, MarkerFindingError
from h3quant.formats import registry
from h3quant.formats.container.reader import TensorInfo
from h3quant.formats.container.dtypes import FLOAT_DTYPES, QUANTIZED_WEIGHT_DTYPES
from h3quant.formats.layers import Layer, marker_disagreement
from h3quant.formats.markers import (
    check_marker_object,
    effective_fields,
    marker_bytes,
    parse_marker_bytes,
)
from h3quant.formats.container.writer import Entry
from h3quant.pipelines.convert.options import ConvertOptions

NEVER_WRITTEN = frozenset({"weight_correction"})  # ComfyUI does not load it (FORMATS.md 4)


@dataclass
class CopyItem:
    """An input tensor written byte for byte (``entry`` may retype it: same bytes)."""

    out: str
    src: TensorInfo
    entry: Entry


@dataclass
class LayerPlan:
    name: str
    action: str  # convert | keep | skip | untouched
    source: str
    target: str | None
    shape: tuple[int, ...]
    src_fields: dict | None = None  # effective fields of the input marker (None: plain float)
    out_fields: dict | None = None  # marker object declared for the output (None: plain)
    inputs: dict[str, TensorInfo] = field(default_factory=dict)
    produced: dict[str, Entry] = field(default_factory=dict)  # computed by the run
    marker: bytes | None = None  # bytes of a produced marker tensor
    copies: list[CopyItem] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    reason: str | None = None
    via: str = "encode"  # convert: encode | relayout | grid (see convert.relayout)
    notes: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    options: ConvertOptions | None = None  # a --layer / --recipe rule's options (None: --to)

    @property
    def weight(self) -> TensorInfo:
        return self.inputs["weight"]

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    def to_dict(self) -> dict:
        d: dict[str, object] = {"name": self.name, "action": self.action, "from": self.source, "to": self.target,
             "shape": list(self.shape)}
        if self.reason:
            d["reason"] = self.reason
        if self.notes:
            d["notes"] = list(self.notes)
        return d


# ---------------------------------------------------------------------------- marker resolution
def _fields_or_error(raw) -> tuple[dict | None, dict | None, str | None]:
    try:
        obj = check_marker_object(raw, "marker")
        return obj, effective_fields(obj), None
    except MarkerError as exc:
        return None, None, exc.reason


def logical_k(layer: Layer, fields: dict | None) -> int | None:
    w = layer.weight
    if w is None or len(w.shape) != 2:
        return None
    return registry.logical_shape(w.shape, fields)[1]


def logical_shape(layer: Layer, fields: dict | None) -> tuple[int, ...]:
    """``(N, K)`` of a layer's 2-D weight (a kn weight is stored [K, N]); else its stored shape."""
    w = layer.weight
    if w is None or len(w.shape) != 2:
        return tuple(w.shape) if w is not None else ()
    return registry.logical_shape(w.shape, fields)


def fit_error(layer: Layer, f: dict) -> str | None:
    """Why the layer's tensors do not match marker fields ``f`` (None when they do)."""
    if layer.weight is None:
        return "marker has no weight tensor beside it"
    codec = registry.get(f["format"])
    if codec is None:
        return None  # unsupported formats are rejected only when the layer is converted
    return codec.spec.rules.fit_error(layer, f)


@dataclass
class Resolved:
    raw: dict | None  # the marker object that counts (None: plain layer)
    fields: dict | None  # its effective fields
    from_tensor: bool = False
    tensor_raw: dict | None = None  # parsed marker tensor (when valid)
    repairs: list[str] = field(default_factory=list)


def resolve_marker(layer: Layer, header: dict | None, read_bytes) -> Resolved:
    """The marker that describes ``layer``'s tensors.

    The per-layer tensor is preferred when it is valid and fits the tensors (the header then gets
    repaired); otherwise a valid, fitting header entry is used (and a marker tensor rewritten).
    """
    name = layer.name
    marker = layer.tensors.get("comfy_quant")
    t_raw = t_eff = h_raw = h_eff = None
    t_err = h_err = None
    if marker is not None:
        if marker.dtype != "U8" or len(marker.shape) != 1:
            t_err = f"marker tensor is {marker.dtype} {list(marker.shape)}, expected 1-D U8"
        else:
            try:
                t_raw = parse_marker_bytes(bytes(read_bytes(f"{name}.comfy_quant")))
            except MarkerError as exc:
                t_err = exc.reason
            else:
                t_raw, t_eff, t_err = _fields_or_error(t_raw)
    in_header = header is not None and name in header
    if header is not None and in_header:
        h_raw, h_eff, h_err = _fields_or_error(header[name])
    if t_raw is None and h_raw is None:
        if marker is not None or in_header:
            errs = "; ".join(e for e in (t_err and f"marker tensor: {t_err}",
                                         h_err and f"header metadata: {h_err}") if e)
            raise FormatError(f"no usable quantization marker ({errs})", tensor=name)
        w = layer.weight
        if w is not None and w.dtype in QUANTIZED_WEIGHT_DTYPES:
            raise FormatError(f"weight is {w.dtype} but the layer has no quantization marker",
                              tensor=f"{name}.weight")
        return Resolved(None, None)
    disagree = marker_disagreement(h_eff, t_eff) if t_eff and h_eff else None
    if disagree:  # validate's M110: which one describes the tensors cannot be known
        raise MarkerFindingError(f"{disagree}; refusing to guess which marker is right; nothing "
                           "written", tensor=name, code="M110")
    tried = []
    for src, raw, eff in (("marker tensor", t_raw, t_eff), ("header metadata", h_raw, h_eff)):
        if raw is None or eff is None:  # both None together (_fields_or_error)
            continue
        why = fit_error(layer, eff)
        if why is None:
            res = Resolved(raw, eff, src == "marker tensor", t_raw)
            _note_repairs(res, name, marker is not None, t_err, header, in_header, h_raw)
            return res
        tried.append(f"{src} says {registry.describe(eff)} but {why}")
    raise FormatError("; ".join(tried), tensor=name)


def _note_repairs(res: Resolved, name, has_tensor, t_err, header, in_header, h_raw) -> None:
    if not res.from_tensor:
        res.repairs.append(f"{name}: marker tensor "
                           + (f"rewritten from header metadata ({t_err})" if has_tensor
                              else "written from header metadata (the file had none)"))
        return
    if header is None:
        return  # a missing header is reported once for the whole file
    if not in_header:
        res.repairs.append(f"{name}: added to _quantization_metadata (was missing)")
    elif h_raw != res.raw:
        res.repairs.append(f"{name}: _quantization_metadata entry {_json(h_raw or header[name])} "
                           f"replaced by the marker tensor's {_json(res.raw)}")


def _json(obj) -> str:
    return marker_bytes(obj).decode() if isinstance(obj, dict) else repr(obj)


# ---------------------------------------------------------------------------- target matching
def same_target(layer: Layer, f: dict, opts: ConvertOptions) -> bool:
    """The layer already stores exactly what the target would write (re-emit it)."""
    marker = opts.marker()
    return marker is not None and opts.codec.spec.planning.same_target(layer, f, marker)


def empty_reason(layer: Layer) -> str | None:
    """A weight with no elements has nothing to encode: it is copied as it is."""
    w = layer.weight
    assert w is not None  # _plan_layer plans only layers with a weight
    shape = list(w.shape)
    return f"weight has no elements (shape {shape}); copied unchanged" if 0 in shape else None


def skip_reason(layer: Layer, fields: dict | None, opts: ConvertOptions) -> str | None:
    w = layer.weight
    assert w is not None  # _plan_layer plans only layers with a weight
    if empty_reason(layer):
        return empty_reason(layer)
    if len(w.shape) != 2:
        return f"weight is not 2-D (shape {list(w.shape)})"
    if fields is None and w.dtype not in FLOAT_DTYPES:
        return f"weight dtype {w.dtype} is not a float type"
    marker = opts.marker()
    if marker is None:
        return None
    k = logical_k(layer, fields)
    assert k is not None  # a 2-D weight
    return opts.codec.spec.planning.skip_reason(k, marker)


def check_supported(layer: Layer, fields: dict | None) -> None:
    """UnsupportedError when the layer's format has no codec (convert cannot read it)."""
    registry.codec_for(fields, tensor=layer.name)
