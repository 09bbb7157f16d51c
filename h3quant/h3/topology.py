"""MiniMax H3 DiT topology: the tensor names, dtypes and shapes of a checkpoint (FORMATS.md 5).

Works on header information only (names, dtypes, shapes); it never reads tensor data.

Where FORMATS.md is silent the layout below is OUR ASSUMPTION, chosen to be plausible:
- ``token_refiner.blocks.{j}`` hold the same sub-layers as a DiT block at hidden width
  (norm1, norm2, attn.qkv_proj, attn.out_proj, attn.q_norm, attn.k_norm, mlp.fc1, mlp.fc2, all
  BF16, no bias) but no adaLN projection, followed by ``token_refiner.final_norm`` (FORMATS.md 5).
  Two such blocks (~1.54 GB BF16) make the 200-linear
  int8 pruned file come to ~20.96 GB, matching the ~20.97 GB FORMATS.md quotes.
- ``time_embedder.proj_in`` is ``[t, 256]`` (256 sinusoidal frequencies) and ``proj_out`` is
  ``[t, t]``, both F32 with bias.
- ``final_layer.adaln_proj.linear`` is ``[2 * hidden, t]`` + bias (shift and scale of the final
  norm), 16-bit like the block adaLN; norms (``norm1``, ``norm2``, ``q_norm``, ``k_norm``,
  ``final_layer.norm``) are BF16 weights without bias.
- The 16-bit adaLN tensors are BF16 in the plain checkpoint.
A checkpoint may prefix every name (e.g. ``model.diffusion_model.``); ``detect`` finds the prefix.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

from h3quant.formats.fp8.spec import SCALED_FP8_MARKER
from h3quant.errors import UnsupportedError
from h3quant.findings import Finding
from h3quant.formats import registry
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.formats.layers import LAYER_SUFFIXES

FORMS = ("full", "pruned")
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# Sub-layers of a DiT block (weights) besides the adaLN projection, and of a refiner block.
_BLOCK_NORMS = ("norm1", "norm2", "attn.q_norm", "attn.k_norm")
# Tensors that may sit beside an expected ``L.weight`` when ``L`` is quantized.
COMPANION_SUFFIXES = frozenset(LAYER_SUFFIXES - {"weight", "bias"})

# Block linears whose input is a linear function of some output rows of another linear of the
# same block, so that dividing those rows by ``s`` divides the input by ``s`` exactly (AWQ's
# channel scaling can be folded there): out_proj reads the attention output, linear in V, the
# last third of qkv_proj's rows ``[q; k; v]`` (q and k pass qk-norm and RoPE, v does not);
# fc2 reads ``silu(gate) * up``, ``up`` the second half of fc1's rows ``[gate; up]``. qkv_proj
# and fc1 read the adaLN-modulated RMSNorm, whose shift comes from another layer: not foldable.
FOLDABLE_INPUTS = {"attn.out_proj": "attn.qkv_proj", "mlp.fc2": "mlp.fc1"}
_FOLD_PARTS = {"attn.out_proj": 3, "mlp.fc2": 2}  # the predecessor's rows: 3 k (q|k|v), 2 k


def fold_predecessor(layer_name: str) -> str | None:
    """The linear whose output rows feed ``layer_name``'s input (``blocks.3.attn.qkv_proj`` for
    ``blocks.3.attn.out_proj``, under the same prefix), or None when no such fold exists."""
    m = _BLOCK_LINEAR_RE.match(layer_name)
    if m is None or m.group(2) not in FOLDABLE_INPUTS:
        return None
    return layer_name[:m.start(2)] + FOLDABLE_INPUTS[m.group(2)]


def folded_rows(layer_name: str, pred_rows: int, k: int) -> tuple[int, int] | None:
    """The rows ``[r0, r1)`` of the predecessor's output that are ``layer_name``'s ``k`` input
    channels in order (v of qkv_proj, up of fc1: the last ``k`` rows), or None when the shapes
    do not chain (``pred_rows`` is not 3 k / 2 k)."""
    m = _BLOCK_LINEAR_RE.match(layer_name)
    if m is None or m.group(2) not in _FOLD_PARTS or k <= 0 \
            or pred_rows != _FOLD_PARTS[m.group(2)] * k:
        return None
    return pred_rows - k, pred_rows


_BLOCK_LINEAR_RE = re.compile(
    r"^(?!(?:.*\.)?token_refiner\.)(?:.*\.)?blocks\.(\d+)\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)$"
)
_ANCHOR = "blocks.0.attn.qkv_proj.weight"
# The most blocks (DiT or refiner) any command accepts: H3 has 50. A header naming a block index
# at or beyond it is finding T106, and its tensors take no part in the detected configuration
# (so no list of that many blocks is ever built).
from h3quant.limits import MAX_BLOCKS  # noqa: E402


@dataclass(frozen=True)
class H3Config:
    hidden: int
    blocks: int
    refiner_blocks: int
    heads: int
    head_dim: int
    ffn: int
    video_patch: int
    audio_patch: int
    text_dim: int
    t_dim: int  # adaLN input width: 8 (pruned curve form) or the time embedder width (full form)
    form: str = "pruned"
    t_freq: int = 256  # time_embedder.proj_in input (full form only)
    t_table_rows: int = 1025  # adaln_t_table rows (pruned form only)
    rope_freqs: int = 16

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv_out(self) -> int:
        return 3 * self.attn_width

    @property
    def fc1_out(self) -> int:
        return 2 * self.ffn

    @property
    def adaln_out(self) -> int:
        return 18 * self.hidden

    @property
    def final_adaln_out(self) -> int:
        return 2 * self.hidden

    def linear_shape(self, sub: str) -> tuple[int, int]:
        """[N, K] of a block linear (``attn.qkv_proj`` ...)."""
        return {
            "attn.qkv_proj": (self.qkv_out, self.hidden),
            "attn.out_proj": (self.hidden, self.attn_width),
            "mlp.fc1": (self.fc1_out, self.hidden),
            "mlp.fc2": (self.hidden, self.ffn),
        }[sub]


# The released (pruned) form of each preset; ``config_for`` derives the full form.
PRESETS: dict[str, H3Config] = {
    "full": H3Config(hidden=5376, blocks=50, refiner_blocks=2, heads=56, head_dim=128, ffn=14336,
                     video_patch=96, audio_patch=32, text_dim=5120, t_dim=8),
    # Every quantizable K (hidden 512, attention 512, ffn 1024) is a multiple of 256; the text
    # width differs from hidden so the condition projection and the token refiner run.
    "tiny": H3Config(hidden=512, blocks=2, refiner_blocks=2, heads=4, head_dim=128, ffn=1024,
                     video_patch=96, audio_patch=32, text_dim=768, t_dim=8),
}
FULL_FORM_T_DIM = {"full": 2688, "tiny": 64}


def config_for(preset: str, blocks: int | None = None, form: str = "pruned") -> H3Config:
    if preset not in PRESETS:
        raise UnsupportedError(f"unknown preset '{preset}' (known: {', '.join(PRESETS)})")
    if form not in FORMS:
        raise UnsupportedError(f"unknown form '{form}' (known: {', '.join(FORMS)})")
    if blocks is not None and (not isinstance(blocks, int) or blocks < 1):
        raise UnsupportedError(f"blocks must be a positive integer, got {blocks!r}")
    base = PRESETS[preset]
    t_dim = FULL_FORM_T_DIM[preset] if form == "full" else base.t_dim
    return replace(base, blocks=blocks or base.blocks, form=form, t_dim=t_dim)


def expected_tensors(cfg: H3Config, prefix: str = "") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the plain (unquantized) checkpoint: name -> (safetensors dtype, shape)."""
    h = cfg.hidden
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def put(name: str, dtype: str, *shape: int) -> None:
        out[prefix + name] = (dtype, tuple(shape))

    def body(stem: str) -> None:
        for sub in BLOCK_LINEARS:
            put(f"{stem}.{sub}.weight", "BF16", *cfg.linear_shape(sub))
        put(f"{stem}.norm1.weight", "BF16", h)
        put(f"{stem}.norm2.weight", "BF16", h)
        put(f"{stem}.attn.q_norm.weight", "BF16", cfg.head_dim)
        put(f"{stem}.attn.k_norm.weight", "BF16", cfg.head_dim)

    put("video_patch_proj.weight", "F32", h, cfg.video_patch)
    put("video_patch_proj.bias", "F32", h)
    put("audio_patch_proj.weight", "F32", h, cfg.audio_patch)
    put("audio_patch_proj.bias", "F32", h)
    put("condition_proj.weight", "BF16", h, cfg.text_dim)
    put("condition_proj.bias", "BF16", h)
    put("rope.inv_freq", "F32", cfg.rope_freqs)
    if cfg.form == "full":
        put("time_embedder.proj_in.weight", "F32", cfg.t_dim, cfg.t_freq)
        put("time_embedder.proj_in.bias", "F32", cfg.t_dim)
        put("time_embedder.proj_out.weight", "F32", cfg.t_dim, cfg.t_dim)
        put("time_embedder.proj_out.bias", "F32", cfg.t_dim)
    else:
        put("adaln_t_table", "F32", cfg.t_table_rows, cfg.t_dim)
    for j in range(cfg.refiner_blocks):
        body(f"token_refiner.blocks.{j}")
    if cfg.refiner_blocks:
        put("token_refiner.final_norm.weight", "BF16", h)
    for i in range(cfg.blocks):
        body(f"blocks.{i}")
        put(f"blocks.{i}.adaln_proj.linear.weight", "BF16", cfg.adaln_out, cfg.t_dim)
        put(f"blocks.{i}.adaln_proj.linear.bias", "BF16", cfg.adaln_out)
    put("final_layer.norm.weight", "BF16", h)
    put("final_layer.adaln_proj.linear.weight", "BF16", cfg.final_adaln_out, cfg.t_dim)
    put("final_layer.adaln_proj.linear.bias", "BF16", cfg.final_adaln_out)
    put("final_layer.video_out.weight", "F32", cfg.video_patch, h)
    put("final_layer.video_out.bias", "F32", cfg.video_patch)
    put("final_layer.audio_out.weight", "F32", cfg.audio_patch, h)
    put("final_layer.audio_out.bias", "F32", cfg.audio_patch)
    return out


def block_linear_names(cfg: H3Config, prefix: str = "") -> list[str]:
    """The 4 * blocks quantizable layer names, ``blocks.{i}.attn.qkv_proj`` ..."""
    return [f"{prefix}blocks.{i}.{sub}" for i in range(cfg.blocks) for sub in BLOCK_LINEARS]


def is_h3_block_linear(layer_name: str) -> bool:
    """True for ``[prefix.]blocks.N.{attn.qkv_proj,attn.out_proj,mlp.fc1,mlp.fc2}`` (not the
    token refiner's blocks)."""
    return _BLOCK_LINEAR_RE.match(layer_name) is not None


def _fmt(value) -> str | None:
    return None if value is None else str(getattr(value, "value", value))


def logical_shape(tensors: dict, name: str, fmt=None) -> tuple[int, ...] | None:
    """The unquantized shape of tensor ``name``: packed 4-bit weights ([N, K/2] with a
    ``weight_s_rel`` companion, or a packed ``fmt``) count as [N, K]."""
    info = tensors.get(name)
    if info is None:
        return None
    shape = tuple(info.shape)
    if name.endswith(".weight") and len(shape) == 2:
        layer = name[: -len(".weight")]
        fmt = _fmt(fmt)
        spec = registry.spec(fmt) if fmt else None
        packed = spec is not None and spec.storage.packed if fmt else f"{layer}.weight_s_rel" in tensors
        if packed:
            return (shape[0], 2 * shape[1])
        if _stored_kn(tensors, layer, shape, fmt):
            return (shape[1], shape[0])
    return shape


def _stored_kn(tensors: dict, layer: str, shape: tuple[int, ...], fmt: str | None) -> bool:
    """An int8_tensorwise_kn weight (stored [K, N], FORMATS.md 9): told by its format, or
    without one by its 1-D scale holding one value per stored column."""
    if fmt:
        spec = registry.spec(fmt)
        return spec is not None and spec.storage.transposed
    scale = tensors.get(f"{layer}.weight_scale")
    return (scale is not None and getattr(tensors[f"{layer}.weight"], "dtype", None) == "I8"
            and len(scale.shape) == 1 and scale.shape[0] == shape[1] != shape[0])


@dataclass(frozen=True)
class Detection:
    config: H3Config
    preset_name: str  # a PRESETS key, or "custom"
    form: str
    blocks: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    prefix: str = ""
    head_bank: int = 1  # output heads stacked in final_layer.video_out / audio_out


BANK_TENSORS = ("final_layer.video_out.weight", "final_layer.video_out.bias",
                "final_layer.audio_out.weight", "final_layer.audio_out.bias")


def head_bank(tensors: dict, prefix: str, cfg: "H3Config") -> int:
    """How many output heads the file stacks: ``n`` when video_out / audio_out hold ``n * 96`` /
    ``n * 32`` rows (weight and bias alike), else 1 (a plain head, or shapes the T102 check
    reports)."""
    rows = []
    for name, width in zip(BANK_TENSORS, (cfg.video_patch,) * 2 + (cfg.audio_patch,) * 2):
        info = tensors.get(prefix + name)
        if info is None or not info.shape or not width or info.shape[0] % width:
            return 1
        rows.append(info.shape[0] // width)
    return rows[0] if len(set(rows)) == 1 and rows[0] > 1 else 1


def refuse_beyond_limit(names, path=None) -> None:
    """Raise ``FindingError`` (T106) for the first tensor naming a block index beyond
    ``MAX_BLOCKS``: what validate reports, convert and verify refuse."""
    from h3quant.errors import FindingError

    for name in names:
        if block_index_beyond_limit(name) is not None:
            raise FindingError(f"block index beyond the limit: at most {MAX_BLOCKS} blocks "
                               f"(0 .. {MAX_BLOCKS - 1}); nothing written", path=path,
                               tensor=name, code="T106")


def _find_prefix(tensors: dict) -> str | None:
    found = []
    for name in tensors:
        if name == _ANCHOR:
            return ""
        if name.endswith("." + _ANCHOR):
            pre = name[: -len(_ANCHOR)]
            if not pre.endswith("token_refiner."):
                found.append(pre)
    return min(found, key=len) if found else None


def _indices(tensors: dict, pattern: str) -> list[int]:
    """Block indices named by ``pattern`` below ``MAX_BLOCKS`` (larger ones are T106)."""
    rx = re.compile(pattern)
    found = set()
    for n in tensors:
        m = rx.match(n)
        if m and len(m.group(1)) <= len(str(MAX_BLOCKS)) and int(m.group(1)) < MAX_BLOCKS:
            found.add(int(m.group(1)))
    return sorted(found)


_INDEX_RE = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def block_index_beyond_limit(name: str) -> int | None:
    """The block index a tensor name gives when it is ``MAX_BLOCKS`` or more (else None). The
    digits are compared by length first: a thousand-digit index is never turned into an int."""
    for m in _INDEX_RE.finditer(name):
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > len(str(MAX_BLOCKS)) or int(digits) >= MAX_BLOCKS:
            return -1 if len(digits) > 18 else int(digits)
    return None


def detect(tensors: dict, formats: dict | None = None) -> Detection | None:
    """Recognise an H3 DiT (float, int8 or W4A8) from its header and infer its configuration.

    ``tensors`` maps names to objects with ``.dtype`` and ``.shape``. Returns None when there is
    no ``blocks.0.attn.qkv_proj.weight`` (under any prefix). ``formats`` maps quantized layer
    names to their marker format, so packed weights are measured by their logical shape.
    """
    prefix = _find_prefix(tensors)
    if prefix is None:
        return None
    notes: list[str] = []
    p = re.escape(prefix)

    def dim(name: str, axis: int) -> int | None:
        layer = prefix + name[: -len(".weight")] if name.endswith(".weight") else None
        shape = logical_shape(tensors, prefix + name, (formats or {}).get(layer))
        return shape[axis] if shape is not None and len(shape) > axis else None

    def first(*values, default):
        return next((v for v in values if v is not None), default)

    qkv_n, qkv_k = dim("blocks.0.attn.qkv_proj.weight", 0), dim("blocks.0.attn.qkv_proj.weight", 1)
    hidden = first(dim("blocks.0.norm1.weight", 0), qkv_k, default=0)
    head_dim = first(dim("blocks.0.attn.q_norm.weight", 0), dim("blocks.0.attn.k_norm.weight", 0),
                     default=128)
    heads = (qkv_n or 0) // (3 * head_dim) if head_dim else 0
    if qkv_n is None or not head_dim or qkv_n % (3 * head_dim):
        notes.append(f"qkv_proj rows {qkv_n} are not 3 x heads x {head_dim}")
    nearest = next((c for c in PRESETS.values() if c.hidden == hidden), PRESETS["full"])
    fc1_n = dim("blocks.0.mlp.fc1.weight", 0)
    ffn = first(dim("blocks.0.mlp.fc2.weight", 1), fc1_n // 2 if fc1_n else None,
                default=nearest.ffn * hidden // nearest.hidden)
    blocks_idx = _indices(tensors, rf"^{p}blocks\.(\d+)\.")
    blocks = blocks_idx[-1] + 1
    absent = sorted(set(range(blocks)) - set(blocks_idx))
    if absent:
        notes.append(f"blocks with no tensor at all: {', '.join(map(str, absent[:20]))}"
                     + (" ..." if len(absent) > 20 else ""))
    refiner_idx = _indices(tensors, rf"^{p}token_refiner\.blocks\.(\d+)\.")
    refiner_blocks = refiner_idx[-1] + 1 if refiner_idx else 0
    t_dim = first(dim("blocks.0.adaln_proj.linear.weight", 1), dim("adaln_t_table", 1),
                  dim("time_embedder.proj_out.weight", 0), default=nearest.t_dim)
    has_table = prefix + "adaln_t_table" in tensors
    has_embedder = any(n.startswith(prefix + "time_embedder.") for n in tensors)
    if has_table and has_embedder:
        notes.append("both adaln_t_table and time_embedder present; taking the pruned form")
    if has_table or has_embedder:
        form = "pruned" if has_table else "full"
    else:
        form = "pruned" if t_dim == 8 else "full"
        notes.append(f"no adaln_t_table or time_embedder; form guessed from t = {t_dim}")
    cfg = H3Config(
        hidden=hidden, blocks=blocks, refiner_blocks=refiner_blocks, heads=heads,
        head_dim=head_dim, ffn=ffn,
        video_patch=first(dim("video_patch_proj.weight", 1), default=nearest.video_patch),
        audio_patch=first(dim("audio_patch_proj.weight", 1), default=nearest.audio_patch),
        text_dim=first(dim("condition_proj.weight", 1), default=nearest.text_dim),
        t_dim=t_dim, form=form,
        t_freq=first(dim("time_embedder.proj_in.weight", 1), default=nearest.t_freq),
        t_table_rows=first(dim("adaln_t_table", 0), default=nearest.t_table_rows),
        rope_freqs=first(dim("rope.inv_freq", 0), default=nearest.rope_freqs),
    )
    preset = next((name for name in PRESETS
                   if config_for(name, blocks=blocks, form=form) == cfg), "custom")
    if prefix:
        notes.append(f"tensor names carry the prefix '{prefix}'")
    bank = head_bank(tensors, prefix, cfg)
    if bank > 1:
        notes.append(f"final_layer output heads: a bank of {bank} heads (few-step checkpoint)")
    return Detection(cfg, preset, form, blocks, tuple(notes), prefix, bank)


def _block_of(name: str, prefix: str) -> str | None:
    m = re.match(rf"^({re.escape(prefix)}blocks\.\d+)\.", name)
    return m.group(1) if m else None


def beyond_limit_finding(name: str) -> Finding | None:
    """T106 for a tensor naming a block index at or beyond ``MAX_BLOCKS`` (else None)."""
    beyond = block_index_beyond_limit(name)
    if beyond is None:
        return None
    index = "a block index of over 18 digits" if beyond < 0 else f"block index {beyond}"
    return Finding("T106", f"{index} is beyond the limit: at most {MAX_BLOCKS} blocks "
                   f"(0 .. {MAX_BLOCKS - 1})", tensor=name)


def check(tensors: dict, detection: Detection | None,
          quantized_layers: dict | None = None) -> list[Finding]:
    """Topology findings (T101..T106) of ``tensors`` against the detected configuration.

    ``quantized_layers`` maps quantized layer names (no ``.weight``) to their format.
    """
    if detection is None:
        return [Finding("T104", f"not recognised as an H3 DiT (no {_ANCHOR})")]
    quantized = {k: _fmt(v) for k, v in (quantized_layers or {}).items()}
    prefix = detection.prefix
    expected = expected_tensors(detection.config, prefix)
    for name in BANK_TENSORS if detection.head_bank > 1 else ():
        dtype, shape = expected[prefix + name]
        expected[prefix + name] = (dtype, (shape[0] * detection.head_bank, *shape[1:]))
    found: list[Finding] = []
    missing = [n for n in expected if n not in tensors]
    per_block = Counter(b for n in expected if (b := _block_of(n, prefix)))
    missing_block = Counter(b for n in missing if (b := _block_of(n, prefix)))
    whole = {b for b, c in missing_block.items() if c == per_block[b]}
    for b in sorted(whole, key=lambda s: int(s.rsplit(".", 1)[1])):
        found.append(Finding("T101", f"block missing entirely ({per_block[b]} tensors)", tensor=b))
    for name in missing:
        if _block_of(name, prefix) not in whole:
            dtype, shape = expected[name]
            found.append(Finding("T101", f"missing ({dtype} {list(shape)} expected)", tensor=name))
    for name, (_, shape) in expected.items():
        if name not in tensors:
            continue
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        got = logical_shape(tensors, name, quantized.get(layer))
        assert got is not None  # name is in tensors
        if got != shape:
            stored = list(tensors[name].shape)
            extra = f" (stored {stored})" if list(got) != stored else ""
            found.append(Finding("T102", f"logical shape {list(got)}{extra}, the detected "
                                 f"configuration needs {list(shape)}", tensor=name))
    for name in tensors:
        if name in expected:
            continue
        beyond = beyond_limit_finding(name)
        if beyond is not None:
            found.append(beyond)
            continue
        layer, _, suffix = name.rpartition(".")
        if suffix in COMPANION_SUFFIXES and f"{layer}.weight" in expected:
            continue
        if suffix == SCALED_FP8_MARKER or name == SCALED_FP8_MARKER:
            continue  # ComfyUI's scaled-fp8 marker: judged by the marker rules (Q131)
        if f"{layer}.weight" in expected:  # e.g. a bias on a linear H3 has without one
            found.append(Finding("T103", "not part of the detected H3 configuration; ComfyUI "
                                 "ignores it, h3quant's forward would use it", tensor=name))
        else:
            found.append(Finding("T108", "not part of H3: an unexpected key ComfyUI's loader "
                                 "ignores, as h3quant does", tensor=name))
    found += _variant_notes(tensors, detection, expected, quantized)
    for layer, fmt in sorted(quantized.items()):
        fspec = registry.spec(_fmt(fmt))
        if fspec is not None and fspec.verify.whole_model:
            continue  # ComfyUI's own releases store every linear so (the fp8_scaled files)
        if not is_h3_block_linear(layer):
            why = " (the token refiner is never quantized in released files)" \
                if "token_refiner." in layer else ""
            found.append(Finding("T105", f"quantized as {fmt} but not one of the DiT block "
                                 f"linears{why}", tensor=layer))
    return found


def _variant_notes(tensors: dict, detection: Detection, expected: dict,
                   quantized: dict) -> list[Finding]:
    """Notes (T107, T109, T110) on what ComfyUI loads although H3's release differs."""
    found: list[Finding] = []
    cfg, prefix = detection.config, detection.prefix
    default_rows = PRESETS["full"].t_table_rows
    if cfg.form == "pruned" and prefix + "adaln_t_table" in tensors \
            and cfg.t_table_rows != default_rows:
        found.append(Finding("T107", f"{cfg.t_table_rows} rows where H3 has {default_rows}: the "
                             "same time curve sampled "
                             f"{'more' if cfg.t_table_rows > default_rows else 'less'} densely, "
                             "interpolated over its own rows", tensor=prefix + "adaln_t_table"))
    cast: dict[tuple[str, str], list[str]] = {}
    for name, (dtype, _) in expected.items():
        info = tensors.get(name)
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if info is None or layer in quantized:
            continue
        got = getattr(info, "dtype", None)
        if got in FLOAT_DTYPES and dtype in FLOAT_DTYPES and got != dtype:
            cast.setdefault((got, dtype), []).append(name)
    for (got, want), names in sorted(cast.items()):
        found.append(Finding("T109", f"{len(names)} tensor(s) stored in {got} where H3 keeps "
                             f"{want} (first shown); it loads as stored, cast on use",
                             tensor=sorted(names)[0]))
    if prefix:
        found.append(Finding("T110", f"every H3 tensor name carries the prefix {prefix!r}, "
                             "stripped on load"))
    return found


def summary(detection: Detection | None, quantized_layers: dict | None = None) -> dict:
    """A JSON-ready description of the detected topology and its quantization coverage."""
    if detection is None:
        return {"detected": False}
    cfg = detection.config
    quantized = {k: _fmt(v) for k, v in (quantized_layers or {}).items()}
    linears = block_linear_names(cfg, detection.prefix)
    linear_set = set(linears)
    formats = Counter(quantized[n] for n in linears if n in quantized)
    return {
        "detected": True,
        "preset": detection.preset_name,
        "form": detection.form,
        "blocks": detection.blocks,
        "refiner_blocks": cfg.refiner_blocks,
        "prefix": detection.prefix,
        "hidden": cfg.hidden,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "ffn": cfg.ffn,
        "t_dim": cfg.t_dim,
        "head_bank": detection.head_bank,
        "block_linears": {"total": len(linears), "quantized": sum(formats.values()),
                          "formats": dict(sorted(formats.items()))},
        "other_quantized": sum(1 for n in quantized if n not in linear_set),
        "notes": list(detection.notes),
    }
