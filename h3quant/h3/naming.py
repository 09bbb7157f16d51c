"""Which naming an H3 checkpoint uses, and how its tensors map onto ComfyUI's single file.

Three namings are known (FORMATS.md 12):

- ``comfy``: ComfyUI's single file (``blocks.N.attn.qkv_proj`` ... ``video_patch_proj``), the
  layout every other h3quant command reads and the only one ComfyUI loads;
- ``official``: the native release shards (``model-000NN-of-000MM.safetensors`` + index). Same
  names as ComfyUI, but each fused ``attn.qkv_proj`` holds its rows per head:
  ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (``head_dim`` rows each) where ComfyUI has
  ``[q_all; k_all; v_all]``. The names alone cannot tell it from ComfyUI's file, so it is
  recognised by its shard file names (or chosen with ``--naming official``);
- ``diffusers``: ``MiniMaxH3Transformer3DModel`` shards: renamed modules, split ``to_q`` /
  ``to_k`` / ``to_v``, and the SwiGLU ``ff.net.0.proj`` in ``[value; gate]`` order where
  ComfyUI's ``mlp.fc1`` is ``[gate; value]``.

Everything here works on names and shapes only and never imports torch. ``plan_mapping`` gives,
for every ComfyUI tensor, its source tensors and the row operation to apply; tensors ComfyUI has
no place for are returned separately so the caller reports them. Each layout's detection, renames
and row operations are its own (``h3quant.h3.layouts``, the single place to correct should a
convention turn out different); this module runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h3quant.formats.fp8.spec import LEGACY_WEIGHT_SCALE, SCALED_FP8_MARKER
from h3quant.errors import FormatError
from h3quant.h3 import layouts
from h3quant.h3.layouts import (  # noqa: F401  (the row operations, re-exported)
    COPY,
    DEINTERLEAVE_QKV,
    FUSE_QKV,
    OFFICIAL_SHARD,
    SWAP_HALVES,
)

NAMINGS = layouts.NAMINGS

# fp8 weights: the scale companions a loader multiplies in, and the ones it does not use.
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
FP8_SCALES = ("scale_weight", "weight_scale")
FP8_UNUSED = ("scale_input", "input_scale")

OP_TEXT = {
    FUSE_QKV: "q/k/v fused as [q; k; v]",
    DEINTERLEAVE_QKV: "per-head [q_h; k_h; v_h] rows regrouped as [q; k; v]",
    SWAP_HALVES: "SwiGLU halves swapped: [value; gate] -> [gate; value]",
}


def is_fp8_weight(name: str, dtype: str) -> bool:
    """An fp8-typed weight (not an fp8 companion such as W4A8's ``weight_s_rel``)."""
    return dtype in FP8_DTYPES and name.endswith(".weight")


def is_scaled_fp8_marker(name: str) -> bool:
    """ComfyUI's legacy ``scaled_fp8`` marker tensor (at the root or under a model prefix)."""
    return name == SCALED_FP8_MARKER or name.endswith("." + SCALED_FP8_MARKER)


def legacy_scaled(tensors) -> set[str]:
    """Unmarked fp8 weights with a ``scale_weight`` companion: what ComfyUI's loader scales
    (as float8_e4m3fn layers) only when the file carries the ``scaled_fp8`` marker."""
    return {n for n in fp8_decodable(tensors)
            if f"{n[:-len('.weight')]}.{LEGACY_WEIGHT_SCALE}" in tensors}


class HeaderTensors(dict):
    """``{name: (dtype, shape)}`` of a checkpoint, with ``marked``: the layers its header
    ``_quantization_metadata`` gives a format (their markers decide, as for a marker tensor)."""

    marked: frozenset[str] = frozenset()


def header_tensors(tensors, header_layers) -> HeaderTensors:
    out = HeaderTensors({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    out.marked = frozenset(header_layers or ())
    return out


def fp8_decodable(tensors) -> set[str]:
    """The unmarked fp8 weights h3quant decodes as plain or scaled fp8 (code x scale).

    A weight with a quantization marker (a ``comfy_quant`` tensor or a header metadata entry)
    is a quantized layer of its format (``float8_e4m3fn``, ``mxfp8`` ...): its codec decodes it.
    A weight whose scale companion is not a float tensor (an E8M0 / U8 block scale) is another
    format stored in fp8: not decoded here either. Any other fp8 weight counts; a float scale of
    the wrong shape is then an N305 error."""
    out = set()
    marked: frozenset[str] = getattr(tensors, "marked", frozenset())
    for name, (dtype, _) in tensors.items():
        if not is_fp8_weight(name, dtype):
            continue
        stem = name[: -len(".weight")]
        if f"{stem}.comfy_quant" in tensors or stem in marked:
            continue
        scales = [f"{stem}.{s}" for s in FP8_SCALES if f"{stem}.{s}" in tensors]
        if any(tensors[sc][0] not in SCALE_DTYPES for sc in scales):
            continue
        out.add(name)
    return out


@dataclass(frozen=True)
class Source:
    name: str
    dtype: str
    shape: tuple[int, ...]
    scale: str | None = None  # fp8: the scale tensor multiplied in
    fp8: bool = False  # an fp8 weight decoded as code x scale (see ``fp8_decodable``)


@dataclass(frozen=True)
class Target:
    name: str
    sources: tuple[Source, ...]
    op: str = COPY
    heads: int = 0  # DEINTERLEAVE_QKV only

    @property
    def fp8(self) -> bool:
        return any(s.fp8 for s in self.sources)

    def describe(self) -> str:
        src = " + ".join(s.name for s in self.sources)
        notes = [OP_TEXT[self.op]] if self.op in OP_TEXT else []
        if self.fp8:
            notes.append("fp8 decoded" + (f" x {self.sources[0].scale}"
                                          if self.sources[0].scale else ""))
        return f"{src} -> {self.name}" + (f" ({'; '.join(notes)})" if notes else "")


@dataclass
class Mapping:
    naming: str
    targets: list[Target] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # source tensors ComfyUI does not load

    @property
    def trivial(self) -> bool:
        """Nothing to do: every target is its own source, unchanged."""
        return all(t.op == COPY and len(t.sources) == 1 and t.sources[0].name == t.name
                   and not t.fp8 for t in self.targets) and not self.unused

    def to_dict(self) -> dict:
        return {"naming": self.naming, "unused": list(self.unused),
                "targets": [{"name": t.name, "sources": [s.name for s in t.sources],
                             "op": t.op, "fp8": t.fp8} for t in self.targets]}


@dataclass(frozen=True)
class Detection:
    naming: str
    evidence: str
    fp8: bool


def detect(tensors: dict[str, tuple[str, tuple[int, ...]]],
           shard_names: list[str] | None = None, has_config: bool = False) -> Detection:
    """The naming of a checkpoint from its tensor names (``{name: (dtype, shape)}``) and, for
    the official release whose names equal ComfyUI's, its shard file names. Refuses a file
    that mixes diffusers and ComfyUI block names (a half-renamed file)."""
    hits = {lay.name: sorted(n for n in tensors if lay.name_hint.search(n))
            for lay in layouts.LAYOUTS.values() if lay.name_hint is not None}
    fp8 = bool(fp8_decodable(tensors))
    mixed = [name for name in layouts.DETECT_ORDER if hits.get(name)]
    if len(mixed) > 1:
        (a, na), (b, nb) = ((layouts.get(m).label, hits[m]) for m in mixed[:2])
        raise FormatError(
            f"[N301] half-renamed checkpoint: {len(na)} {a} name(s) (e.g. {na[0]}) and "
            f"{len(nb)} {b} name(s) (e.g. {nb[0]}) in one file; convert from the "
            "original download", tensor=na[0], code="N301")
    for name in layouts.DETECT_ORDER:
        evidence = layouts.get(name).detect(hits, shard_names or [], has_config)
        if evidence is not None:
            return Detection(name, evidence, fp8)
    raise AssertionError("the comfy layout always matches")  # pragma: no cover


SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})


def check_fp8_scales(mapping: Mapping, tensors) -> None:
    """Shape and dtype rules of the fp8 scales (N305): F32/BF16/F16, one value per tensor
    (``[]`` / ``[1]``) or per output row (``[N]`` / ``[N, 1]``)."""
    for t in mapping.targets:
        for s in t.sources:
            if s.scale is None:
                continue
            dtype, shape = tensors[s.scale]
            n = s.shape[0] if s.shape else 1
            count = 1
            for d in shape:
                count *= d
            if dtype not in SCALE_DTYPES:
                raise _fail("N305", f"fp8 scale is {dtype}; expected one of "
                            f"{', '.join(sorted(SCALE_DTYPES))}", s.scale)
            if count not in (1, n) or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
                raise _fail("N305", f"fp8 scale shape {list(shape)}: expected one value per "
                            f"tensor ([] or [1]) or per output row ([{n}] or [{n}, 1])", s.scale)


def fp8_scaled_weights(tensors) -> set[str]:
    """The fp8 weights stored with a scale companion (ComfyUI's scaled-fp8 layout)."""
    return {n for n in fp8_decodable(tensors)
            if any(f"{n[:-len('.weight')]}.{s}" in tensors for s in FP8_SCALES)}


def staged_entries(mapping: Mapping, quantized_target: bool = False
                   ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ComfyUI name -> (dtype, shape) of the single file convert sees: fp8 becomes F32 (for a
    quantized target) or BF16; a fused q/k/v has three times its parts' rows."""
    out = {}
    for t in mapping.targets:
        s = t.sources[0]
        dtype = ("F32" if quantized_target else "BF16") if t.fp8 else s.dtype
        shape = ((3 * s.shape[0],) + tuple(s.shape[1:])) if t.op == FUSE_QKV else s.shape
        out[t.name] = (dtype, tuple(shape))
    return out


diffusers_to_comfy = layouts.diffusers_to_comfy


def _fail(code: str, msg: str, tensor: str) -> FormatError:
    return FormatError(f"[{code}] {msg}", tensor=tensor, code=code)


def _source(tensors, name: str, decodable: set[str]) -> Source:
    dtype, shape = tensors[name]
    scale = None
    if name in decodable:
        stem = name[: -len(".weight")]
        scale = next((f"{stem}.{s}" for s in FP8_SCALES if f"{stem}.{s}" in tensors), None)
    return Source(name, dtype, tuple(shape), scale, name in decodable)


def _heads(tensors, stem: str, rows: int, naming: str) -> int:
    """Number of heads of ``stem``'s attention, from its ``q_norm`` width (head_dim)."""
    for norm in (f"{stem}.attn.q_norm.weight", f"{stem}.attn.norm_q.weight"):
        if norm in tensors and len(tensors[norm][1]) == 1:
            d = tensors[norm][1][0]
            if d and rows % (3 * d) == 0:
                return rows // (3 * d)
    raise _fail("N304", f"{naming} qkv_proj of {rows} rows: no q_norm of a width dividing "
                f"rows / 3 to find the heads from", f"{stem}.attn.qkv_proj.weight")


def plan_mapping(tensors: dict[str, tuple[str, tuple[int, ...]]], naming: str) -> Mapping:
    """Every ComfyUI tensor of ``tensors`` (in ``naming``) with its sources and row operation.

    Raises ``FormatError`` (code N302: a missing q, k or v; N303: q, k, v of different shapes;
    N304: heads not derivable) before anything is read."""
    if naming not in NAMINGS:
        raise FormatError(f"unknown naming {naming!r} (known: {', '.join(NAMINGS)})")
    out = Mapping(naming)
    consumed: set[str] = set()
    decodable = fp8_decodable(tensors)
    for name in tensors:  # fp8 scale companions travel with their weight
        stem, _, suffix = name.rpartition(".")
        if is_scaled_fp8_marker(name):  # the output holds no legacy fp8 layers: never true there
            out.unused.append(name)
            consumed.add(name)
            continue
        if f"{stem}.weight" not in decodable:
            continue
        if suffix in FP8_SCALES:
            consumed.add(name)
        elif suffix in FP8_UNUSED or suffix == "comfy_quant":
            out.unused.append(name)
            consumed.add(name)
    groups: dict[tuple[str, str], dict[str, str]] = {}
    layout = layouts.get(naming)
    for name in sorted(tensors):
        if name in consumed:
            continue
        m = layout.split_qkv(name)
        if m:
            groups.setdefault((m["stem"], m["kind"]), {})[m["part"]] = name
            continue
        target = layout.rename(name)
        src = _source(tensors, name, decodable)
        op = layout.row_op(name)
        if op == SWAP_HALVES and src.shape[0] % 2:
            raise _fail("N303", f"SwiGLU projection of odd rows {src.shape[0]}", name)
        if op == DEINTERLEAVE_QKV:
            stem = name[: -len(".attn.qkv_proj.weight")]
            out.targets.append(Target(target, (src,), op,
                                      _heads(tensors, stem, src.shape[0], naming)))
            continue
        out.targets.append(Target(target, (src,), op))
    for (stem, kind), parts in sorted(groups.items()):
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise _fail("N302", f"attention {stem}: to_{'/to_'.join(missing)}.{kind} missing "
                        f"(found to_{'/to_'.join(sorted(parts))})", f"{stem}.attn.to_q.{kind}")
        srcs = tuple(_source(tensors, parts[p], decodable) for p in "qkv")
        shapes = {s.shape for s in srcs}
        dtypes = {s.dtype for s in srcs}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise _fail("N303", f"attention {stem}: to_q/to_k/to_v.{kind} differ: "
                        + ", ".join(f"{s.dtype} {list(s.shape)}" for s in srcs),
                        parts["q"])
        out.targets.append(Target(layout.rename(f"{stem}.attn.qkv_proj.{kind}"), srcs, FUSE_QKV))
    names = [t.name for t in out.targets]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise _fail("N301", f"two source tensors map onto {dup[0]} (a half-renamed file)",
                    dup[0])
    out.targets.sort(key=lambda t: t.name)
    out.unused.sort()
    return out
