"""What a format is, as data: its identity and, grouped by the engine that reads them, its
tensor set and header rules (``storage``), how convert writes it (``encoding``) or moves its
codes (``relayout``), how the runtime runs it (``runtime``) and what verify checks
(``verify``). Torch-free.

Each format package (``h3quant.formats.int8`` ...) exports one ``SPEC``: a ``FormatSpec`` (with
subclasses of the method facets ``reading``, ``planning``, ``rules`` where its header rules
differ, such as W4A8's packed width) and, where
h3quant can encode and decode it, a ``CODEC`` (``h3quant.formats.codec``). The engines in
``h3quant.formats`` (markers, layers, check, deep) read these specs through the one registry
(``h3quant.formats.registry``) instead of testing format names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from h3quant.convrot.groups import is_valid_group_size
from h3quant.formats.container.dtypes import FLOAT_DTYPES

# Allowed shapes given (N, K, fields); None = any shape.
ShapeRule = Callable[[int, int, dict], list[tuple[int, ...]]]

SCALE_DTYPES = ("F32",)
FLOATS = tuple(sorted(FLOAT_DTYPES))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a format's layer: suffix, legal dtypes and shapes (of logical N, K)."""

    suffix: str
    dtypes: tuple[str, ...]
    shapes: ShapeRule | None
    shape_text: str
    required: bool = True
    at_least: bool = False  # padded layouts: same rank, every dim >= the expected one

    def describe(self) -> str:
        return f"{'/'.join(self.dtypes)} {self.shape_text}"


BIAS = TensorSpec("bias", FLOATS, lambda n, k, f: [(n,)], "[N]", required=False)


def scalar(n: int, k: int, f: dict) -> list[tuple[int, ...]]:
    return [(), (1,)]


@dataclass(frozen=True)
class Target:
    """A ``convert --to`` choice: the format (wire name) that writes it and its fixed parameters."""

    name: str
    codec: str
    convrot: bool
    help: str


@dataclass(frozen=True)
class RowRange:
    """Legal peak |code| of a quantized layer's int8 grid (per row, or one peak per tensor)."""

    per_tensor: bool
    low: int
    high: int
    no_min128: bool  # the encoder never writes -128
    text: str
    alt: RowRange | None = None  # accepted instead when every row fits it (a known other source)

    def misses(self, peak, qmin):
        """Rows (bool tensor) whose peak |q| or minimum code break the rule."""
        bad = (peak < self.low) | (peak > self.high)
        return bad | (qmin == -128) if self.no_min128 else bad


@dataclass(frozen=True)
class VerifyLimits:
    """``verify`` limits for layers of a format (block limits apply to the loosest format present)."""

    rel_err: float  # relative L2 error of the layer's output against the float reference
    block_sqnr_db: float  # SQNR of an H3 block's residual update


@dataclass(frozen=True)
class Violation:
    """One broken tensor rule: finding code, message, and the tensor suffix it is about."""

    code: str
    message: str
    suffix: str = "weight"


def packed_weight(fmt: str, tensors: dict, dtype: str, codes: str, shape: str
                  ) -> tuple[list[Violation], tuple[int, int] | None]:
    """The header rules every two-codes-per-byte weight shares: present (Q101), stored as
    ``dtype`` (Q102) and 2-D (Q103). Returns the violations and the logical ``(N, K)`` (K = twice
    the stored columns), None when the weight is missing or not 2-D. ``codes`` names what a byte
    holds ("int4 codes"), ``shape`` the stored shape ("[N, K/2]")."""
    w = tensors.get("weight")
    if w is None:
        return [Violation("Q101", f"{fmt} layer has no weight (expected {dtype} {shape})")], None
    out: list[Violation] = []
    if w.dtype != dtype:
        out.append(Violation("Q102", f"weight is {w.dtype}, expected {dtype} (two {codes} per "
                             "byte)"))
    if len(shape_of(w)) != 2:
        return out + [Violation("Q103", f"weight is {list(shape_of(w))}, expected a 2-D {dtype} "
                                f"{shape}")], None
    return out, (shape_of(w)[0], 2 * shape_of(w)[1])


def shape_of(t) -> tuple[int, ...]:
    return tuple(t.shape)


@dataclass(frozen=True)
class KitchenFacts:
    """How ComfyUI reads a format through comfy-kitchen (FORMATS.md 26), as data.

    ComfyUI's ``comfy/ops.py`` runs a layer on the layout's kernel when the layout's
    ``supports_fast_matmul()`` is true; comfy-kitchen's rule is a CUDA capability of at least the
    layout's ``MIN_SM_VERSION`` (no CUDA device: false; no minimum: true everywhere). Otherwise
    ComfyUI dequantizes the weight to the compute dtype and runs a float matmul."""

    layout: str  # comfy-kitchen's layout class
    min_sm: tuple[int, int] | None  # the layout's MIN_SM_VERSION (None: no architecture floor)
    since: str  # the first comfy-kitchen release that registers the layout
    comfyui: str = ""  # the ComfyUI release, where known ("": not checked)
    # (device class, cell, note): a class where the rule above is not the whole answer; cell
    # "unverified" or "emulated" replaces "dequant" there ("": the note only)
    notes: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class StorageFacet:
    """What the header engines read (``markers``, ``layers``, ``check``, ``transpose``, the
    topology): the tensor set and its rules, the marker's defaults, how the weight is packed
    and laid out."""

    tensors: tuple[TensorSpec, ...] = ()  # the tensor set, declared once
    closed: bool = True  # tensors outside ``tensors`` are flagged (Q106)
    marker_defaults: dict[str, Any] = field(default_factory=dict)  # what a loader assumes
    packed: bool = False  # two 4-bit codes per byte along K: stored [N, K/2]
    opaque: bool = False  # the logical [N, K] cannot be told from the header
    always_convrot: bool = False  # the format rotates whatever its marker says
    convrot_rules: bool = False  # ConvRot group-size rules apply to the marker (Q104)
    transposed_outputs: tuple[str, ...] = ()  # encode() gives [n, K] rows, stored as [K, N]
    column_sources: tuple[str, ...] = ()  # stored [K, N]: layer row r is stored column r

    @property
    def transposed(self) -> bool:
        """The weight is stored ``[K, N]``."""
        return bool(self.column_sources)

    @property
    def suffixes(self) -> frozenset[str]:
        """Every tensor suffix of the format's layers (the marker tensor included)."""
        return frozenset(t.suffix for t in self.tensors) | {"comfy_quant"}


@dataclass(frozen=True)
class EncodingFacet:
    """What convert's encoder reads: the ``--to`` choices the format writes, how its layers are
    cut into work (row chunks, two streamed passes, or the whole layer), what it refuses and
    what its codec's encoder takes (statistics, channel scaling)."""

    targets: tuple[Target, ...] = ()
    chunked: bool = True  # encodes independent row chunks (else the whole layer at once)
    # not chunked, yet encoded in row chunks: a first pass over the rows gives the layer-wide
    # value (an amax: ``codec.encoder.scan_rows`` / ``layer_value``), then ``codec.encoder.encode_rows`` encodes
    # chunks of a multiple of ``chunk_rows`` rows with it (bounded memory, same bytes)
    streamed: bool = False
    chunk_rows: int = 1
    unrowed_outputs: tuple[str, ...] = ()  # outputs that are not indexed by row (a codebook)
    write_refusal: str | None = None  # why convert cannot write the format (None: it can)
    # why convert cannot copy a layer of this format into its output either (a read-only
    # format: every such layer must be converted to another format); None: it can
    kept_refusal: str | None = None
    calibrates: bool = False  # the codec's encode() takes statistics (``calibration``)
    # the codec's channel_scale() searches per-input-channel scales s (the weight stored as
    # W diag(s), its input divided by s in the layer before): AWQ's scaling
    scales_channels: bool = False
    scans: bool = False  # a streamed encoder needs a first pass (``codec.encoder.scan_rows``)
    sampled_by_column: tuple[str, ...] = ()  # outputs stored [*, N]: the report samples columns
    linear_dtype_cost: str = ""  # what asking for int8 activations costs (``with_linear_dtype``)


@dataclass(frozen=True)
class RelayoutFacet:
    """What convert reads to move stored codes instead of quantizing them (a relayout between a
    format and its layout variant, or a conversion through a format's int8 grid)."""

    int8_codes: bool = False  # weight holds int8 codes (validate --deep counts -128s)
    # the tensor of per-row scales copied beside the codes (a layout variant and its canonical
    # format both name it)
    row_scale: str | None = None
    # The decoded weights lie on an int8 grid with per-row scales (the codec's ``grid_rows``
    # gives its codes from the ``grid_rows`` tensors' rows and the ``grid_whole`` ones; the
    # scale is the ``grid_scale`` tensor), so an int8 format stores them without requantizing.
    grid_rows: tuple[str, ...] = ()
    grid_whole: tuple[str, ...] = ()
    grid_scale: str | None = None
    # the plan's note for each way (a relayout: the canonical format's ``relayout_note``; a
    # conversion through the grid: the source's ``grid_note``)
    relayout_note: str | None = None
    grid_note: str | None = None


@dataclass(frozen=True)
class RuntimeFacet:
    """What the runtime and the device tables read: the tensors a runtime linear loads, how
    ComfyUI runs the format (or, where it does not load it, what does) and how h3quant's
    runtime follows it (decoded, a kernel, an emulated forward)."""

    tensors: tuple[str, ...] = ()  # suffixes the runtime loads (bias aside)
    required: tuple[str, ...] = ()  # of those, the ones a layer must have
    kitchen: KitchenFacts | None = None  # how ComfyUI runs it (None: ComfyUI does not load it)
    load_note: str = ""  # for a format ComfyUI does not load: what does, and what to make instead
    decodes: bool = False  # the runtime may run the layer through ``codec.decoder.decode_weight`` (float)
    kernel: tuple[str, tuple[int, int]] | None = None  # (ComfyUI's kernel, min CUDA capability)
    # (what ComfyUI runs, device kinds) where ComfyUI runs this format's emulated forward (its
    # activation quantization included) instead of a dequantized weight: the runtime then calls
    # ``codec.emulator.emulated_linear`` there. None: ComfyUI dequantizes wherever it has no kernel.
    emulation: tuple[str, tuple[str, ...]] | None = None
    needs_row0: bool = False  # decode_rows gets the chunk's first row (``_row0``): scales tiled by rows


@dataclass(frozen=True)
class VerifyFacet:
    """What ``verify`` and ``validate --deep`` read: the error limits, the tensors whose values
    are checked, the limit class and the topology exception."""

    limits: VerifyLimits | None = None  # None: no limits of its own (the loosest format's apply)
    deep_scales: tuple[str, ...] = ()  # scale tensors whose values must be finite and > 0
    deep_whole: tuple[str, ...] = ()  # tensors whose values the codec checks (``data_violation``)
    weight_bits: int = 16  # bits per stored weight code: verify's limits are per class (8 or 4)
    # ComfyUI's own releases in this format store every linear in it (the fp8_scaled files:
    # the token refiner too), and convert keeps such layers as they are: a layer outside the
    # DiT blocks stored in it is expected, not flagged (T105).
    whole_model: bool = False


class SpecFacet:
    """A facet of header-rule methods a format may override (subclass the facet, pass an
    instance to ``FormatSpec``). The spec binds its own copy of the facet when it is made, so
    a method reads the spec's identity and data facets as ``self.spec``."""

    spec: FormatSpec


class ReadingFacet(SpecFacet):
    """How a reader sees a layer from its header: the logical shape of a stored weight, whether
    it is rotated and its short description (``registry``, ``check``, the runtime's loaders)."""

    def logical_k(self, cols: int, fields: dict | None) -> int:
        """Logical input width K of a stored weight with ``cols`` columns."""
        return 2 * cols if self.spec.storage.packed else cols

    def logical_shape(self, shape: tuple[int, int], fields: dict | None) -> tuple[int, int]:
        """Logical ``(N, K)`` of a stored 2-D weight of ``shape``."""
        if self.spec.storage.transposed:
            return shape[1], shape[0]
        return shape[0], self.logical_k(shape[1], fields)

    def header_nk(self, layer) -> tuple[int | None, int | None]:
        """Logical ``(N, K)`` of a layer whose weight is 2-D, from its header entries."""
        if self.spec.storage.opaque:
            return None, None
        return self.logical_shape(tuple(layer.weight.shape), layer.fields)

    def uses_convrot(self, fields: dict | None) -> bool:
        return self.spec.storage.always_convrot or bool(fields and fields.get("convrot"))

    def describe(self, fields: dict | None) -> str:
        """Short text for a layer's storage (``int8_tensorwise convrot g=256`` ...)."""
        return self.spec.name


class PlanningFacet(SpecFacet):
    """What convert's planner reads: the marker a target writes, whether a layer already holds
    it, why a layer cannot take it, the tensors it plans and how kept tensors are declared."""

    def marker(self, target: Target, group_size: int) -> dict | None:
        """The canonical marker object ``target`` writes (None: a plain layer, no marker)."""
        return None

    def same_target(self, layer, fields: dict, marker: dict | None) -> bool:
        """The layer already stores exactly what ``marker`` would be written as (re-emit it)."""
        return False

    def skip_reason(self, k: int, marker: dict | None) -> str | None:
        """Why a layer of input width ``k`` cannot be written with ``marker`` (None: it can)."""
        return None

    def with_linear_dtype(self, marker: dict, dtype: str) -> dict | None:
        """``marker`` asking ComfyUI's kernel to multiply with ``dtype`` activations (INT4
        ConvRot's ``linear_dtype``), or None where the format has no such choice."""
        return None

    def planned(self, n: int, k: int, marker: dict | None) -> dict[str, tuple[str, tuple]]:
        """Output tensors ``{suffix: (dtype, shape)}`` of one layer (marker tensor aside)."""
        return {"weight": ("BF16", (n, k))}

    def keep_declared(self, suffix: str, dtype: str, shape: tuple, n: int) -> tuple[str, tuple]:
        """How a kept (re-emitted) tensor is declared: same bytes, canonical dtype and shape."""
        return dtype, shape

    def kept_marker(self, code_dtype: str) -> dict | None:
        """The marker of a per-layer layer of this format holding a source's codes of
        ``code_dtype`` unchanged, with their one scale as ``weight_scale`` (None: this format
        keeps no such codes)."""
        return None


class RulesFacet(SpecFacet):
    """The header rules ``check`` applies for validate, convert and verify: the tensor rules of
    a layer (``layer_violations``) and validate's scheme-check hooks."""

    def tensor_violations(self, n: int, cols: int, fields: dict,
                          tensors: dict) -> tuple[int, int, list[Violation]]:
        """Format-specific rules of a layer with a 2-D weight of ``n`` rows, ``cols`` columns:
        (logical N, logical K, violations). Only formats h3quant converts define them."""
        return n, cols, []

    def combination_violations(self, fields: dict, tensors: dict) -> list[Violation]:
        """Rules across a layer's marker fields and tensors (beyond one tensor's dtype/shape)."""
        return []

    def layer_violations(self, fields: dict, tensors: dict) -> list[Violation]:
        """Every tensor rule of a layer of this format (the rules convert and verify refuse
        by). ``tensors`` maps suffix -> an object with ``dtype`` (safetensors name) and ``shape``."""
        fmt = self.spec.name
        w = tensors.get("weight")
        if w is None:
            return [Violation("Q101", f"{fmt} layer has no weight")]
        wdtypes = self.spec.storage.tensors[0].dtypes if self.spec.storage.tensors else ("I8",)
        if w.dtype not in wdtypes or len(shape_of(w)) != 2:
            return [Violation("Q102", f"weight is {w.dtype} {list(shape_of(w))}, {fmt} needs a "
                              f"2-D {'/'.join(wdtypes)} weight")]
        rows, cols = shape_of(w)  # 2-D, checked above
        n, k, out = self.tensor_violations(rows, cols, fields, tensors)
        out.extend(self.combination_violations(fields, tensors))
        # (kn: k is the stored row count)
        if fields.get("convrot") or self.spec.storage.always_convrot:
            g = fields.get("convrot_groupsize", 256)
            if not is_valid_group_size(g) or k % g:
                out.append(Violation("Q104", f"convrot_groupsize {g!r} is not a power of 4 "
                                     f"dividing K={k}"))
        b = tensors.get("bias")
        if b is not None and (b.dtype not in ("F32", "F16", "BF16", "F64") or shape_of(b) != (n,)):
            out.append(Violation("Q103", f"bias is {b.dtype} {list(shape_of(b))}, expected a "
                                 f"float [{n}]", "bias"))
        return out

    def fit_error(self, layer, fields: dict) -> str | None:
        """The first tensor-rule violation of ``layer`` as one line (what convert refuses)."""
        found = self.layer_violations(fields, layer.tensors)
        if not found:
            return None
        v = found[0]
        return f"[{v.code}] {v.suffix}: {v.message}" if v.suffix != "weight" else \
            f"[{v.code}] {v.message}"

    # validate's scheme check: hooks around the tensor set's checks
    def skip_shape(self, suffix: str, layer) -> bool:
        """A tensor whose shape another rule of the format judges (``header_findings``)."""
        return False

    def header_findings(self, layer, n: int | None, k: int | None, add) -> list | None:
        """Format-specific findings before the per-tensor checks, reported through
        ``add(code, msg, suffix)`` or returned as a list of findings."""
        return None

    def extra_findings(self, layer, add) -> None:
        """Format-specific findings after the tensor set (extra tensors, ...)."""

    def constraints(self, layer, k: int, add) -> None:
        """Format-specific rules on the marker's fields against K (after ConvRot's)."""


METHOD_FACETS = ("reading", "planning", "rules")


@dataclass(frozen=True)
class FormatSpec:
    """One on-disk layer format: its identity and its facets.

    Its identity is at the top; everything else is grouped by the engine that reads it:
    ``storage`` (header engines), ``encoding`` (convert's encoder), ``relayout`` (convert's
    code moves), ``runtime`` (the runtime, device tables) and ``verify`` (verify, validate),
    data; ``reading`` (a layer's logical shape), ``planning`` (convert's planner) and ``rules``
    (the header rules), methods a format overrides by subclassing the facet."""

    name: str  # the marker's ``format`` value ("float" for the plain format: no marker)
    description: str
    quantized: bool = True
    comfy: bool = True  # ComfyUI knows the format (the NPU layout is h3quant's own)
    layout: str = "canonical"  # "npu": a pre-transposed layout of the format named ``canonical``
    canonical: str | None = None  # for a layout variant: the format it re-lays out
    # another name for the format ``alias_of``: read as that format, and a layer kept by
    # convert is written under that format's name (never under this one)
    alias_of: str | None = None
    storage: StorageFacet = field(default_factory=StorageFacet)
    encoding: EncodingFacet = field(default_factory=EncodingFacet)
    relayout: RelayoutFacet = field(default_factory=RelayoutFacet)
    runtime: RuntimeFacet = field(default_factory=RuntimeFacet)
    verify: VerifyFacet = field(default_factory=VerifyFacet)
    reading: ReadingFacet = field(default_factory=ReadingFacet)
    planning: PlanningFacet = field(default_factory=PlanningFacet)
    rules: RulesFacet = field(default_factory=RulesFacet)

    def __post_init__(self) -> None:
        for name in METHOD_FACETS:  # each spec binds its own copy (a facet object may be shared)
            facet = copy.copy(getattr(self, name))
            facet.spec = self
            object.__setattr__(self, name, facet)

    # ------------------------------------------------------------------ derived facts
    @property
    def format(self) -> str | None:
        """The marker's wire name (None for the plain format: it has no marker)."""
        return self.name if self.quantized else None
