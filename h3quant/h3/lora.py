"""LoRA files: recognise the key style and map each adapter to the H3 layer rows it changes.

Torch-free: works on tensor names and shapes only. ``parse`` groups a LoRA file's keys into
adapters (one ``down``/``up`` pair and an optional ``alpha`` per module); ``resolve`` maps each
adapter onto a layer of a base checkpoint and the row range it writes (a split ``to_q``/``to_k``/
``to_v`` adapter writes one third of the fused ``attn.qkv_proj`` rows; a diffusers SwiGLU
``ff.net.0.proj`` adapter is ``[value; gate]`` and lands swapped in the ``[gate | up]`` fc1).
Bad input is an ``UnsupportedError`` that names the keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from h3quant.errors import LoraError
from h3quant.h3.naming import diffusers_to_comfy
from h3quant.limits import MAX_LORA_RANK

# (down suffix, up suffix) pairs, in the order they are tried.
_PAIRS = ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight"),
          (".lora_A.default.weight", ".lora_B.default.weight"),  # PEFT's adapter-name infix
          (".lora.down.weight", ".lora.up.weight"))
_ALPHA = ".alpha"
# Key fragments of adapter types that are not a plain low-rank pair.
_UNSUPPORTED = {".hada_": "LoHa", ".lokr_": "LoKr", ".dora_scale": "DoRA magnitude",
                ".lora_magnitude_vector": "DoRA magnitude", ".diff": "full diff",
                ".diff_b": "full bias diff", ".w_norm": "GLoRA/norm", ".b_norm": "GLoRA/norm",
                ".a1.weight": "GLoRA", ".oft_": "OFT", ".boft_": "BOFT"}
_COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_DIFFUSERS_PREFIXES = ("base_model.model.transformer.", "base_model.model.", "transformer.")
_KOHYA_PREFIX = "lora_unet_"
# diffusers / PEFT module name -> (H3 layer suffix, part). Parts: q/k/v are thirds of the fused
# qkv rows; "swiglu" is a full fc1 adapter in [value; gate] row order.
DIFFUSERS_NAMES = {
    "attn.to_q": ("attn.qkv_proj", "q"),
    "attn.to_k": ("attn.qkv_proj", "k"),
    "attn.to_v": ("attn.qkv_proj", "v"),
    "attn.to_qkv": ("attn.qkv_proj", None),
    "attn.to_out.0": ("attn.out_proj", None),
    "ff.net.0.proj": ("mlp.fc1", "swiglu"),
    "ff.net.2": ("mlp.fc2", None),
}


@dataclass(frozen=True)
class Adapter:
    """One low-rank adapter: ``delta = (alpha / rank) * up @ down`` on ``module``."""

    module: str  # the module name as written in the file, without the pair suffix
    down: str  # key of A, [rank, K]
    up: str  # key of B, [N_part, rank]
    alpha: str | None  # key of the scalar alpha (None: alpha = rank)
    rank: int
    style: str


@dataclass(frozen=True)
class Target:
    """Where an adapter lands: ``layer`` of the base, rows ``[row0, row0 + rows)``; ``swap``
    halves the adapter's rows (diffusers ``[value; gate]`` onto ``[gate | up]``)."""

    adapter: Adapter
    layer: str
    row0: int
    rows: int
    swap: bool = False


class LoraStyle(Protocol):
    """A LoRA key style: how to recognise its module names and map one onto an H3 layer."""

    @property
    def name(self) -> str:
        """The ``--style`` value."""

    @property
    def help(self) -> str:
        """What it looks like, for the CLI's help."""

    def claims(self, module: str) -> bool:
        """The module name is written in this style (by its prefix)."""

    def layer(self, module: str, layers: Layers) -> tuple[str | None, str | None]:
        """(the base's layer name without its prefix, or None; the part of its rows: q, k, v,
        swiglu or None for all of them)."""


class Layers(dict):
    """The base's layer names without their prefix (``blocks.0.attn.qkv_proj``) -> full names."""

    @functools.cached_property
    def underscored(self) -> dict[str, str]:
        return {name.replace(".", "_"): name for name in self}


@dataclass(frozen=True)
class ComfyUIStyle:
    name: str = "comfyui"
    help: str = "ComfyUI / musubi-tuner (diffusion_model. prefix, lora_down / lora_up, alpha)"

    def claims(self, module):
        return module.startswith(_COMFY_PREFIXES)

    def layer(self, module, layers):
        return _strip(module, _COMFY_PREFIXES), None


@dataclass(frozen=True)
class KohyaStyle:
    name: str = "kohya"
    help: str = "kohya (lora_unet_blocks_0_attn_qkv_proj)"

    def claims(self, module):
        return module.startswith(_KOHYA_PREFIX)

    def layer(self, module, layers):
        return layers.underscored.get(module[len(_KOHYA_PREFIX):]), None


@dataclass(frozen=True)
class DiffusersStyle:
    name: str = "diffusers"
    help: str = "diffusers / PEFT (split to_q/to_k/to_v, SwiGLU [value; gate])"

    def claims(self, module):
        return module.startswith(_DIFFUSERS_PREFIXES)

    def by_module_names(self, module: str) -> bool:
        """Unprefixed: the block's module names are diffusers' (``attn.to_q`` ...)."""
        tail = module.split("blocks.", 1)[-1]
        return any(tail.endswith("." + d) for d in DIFFUSERS_NAMES)

    def layer(self, module, layers):
        stem, part = _strip(module, _DIFFUSERS_PREFIXES), None
        for dname, (h3, p) in DIFFUSERS_NAMES.items():
            if stem.endswith("." + dname):
                stem, part = stem[: -len(dname)] + h3, p
                break
        # diffusers module names (transformer_blocks.N, proj_in, norm_out, ...) -> ComfyUI's
        return diffusers_to_comfy(stem + ".weight")[: -len(".weight")], part


# The registry: CLI order (the first is the default); ``_style_of`` asks them in this order.
LORA_STYLES: dict[str, LoraStyle] = {s.name: s for s in (ComfyUIStyle(), KohyaStyle(),
                                                         DiffusersStyle())}
STYLES = tuple(LORA_STYLES)
STYLE_HELP = {s.name: s.help for s in LORA_STYLES.values()}
_DETECT_ORDER = (KohyaStyle.name, ComfyUIStyle.name, DiffusersStyle.name)


def _style_of(module: str) -> str:
    for name in _DETECT_ORDER:
        if LORA_STYLES[name].claims(module):
            return name
    diffusers = DiffusersStyle()
    return diffusers.name if diffusers.by_module_names(module) else ComfyUIStyle.name


def parse(shapes: dict[str, tuple[int, ...]], source: str = "LoRA") -> list[Adapter]:
    """Group ``name -> shape`` of a LoRA file into adapters; raise on keys that form none."""
    bad = sorted(k for k in shapes if any(f in k for f in _UNSUPPORTED))
    if bad:
        kinds = sorted({v for f, v in _UNSUPPORTED.items() if any(f in k for k in bad)})
        raise LoraError(f"{source}: adapter type(s) {', '.join(kinds)} not supported "
                               f"(keys: {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''})")
    used: set[str] = set()
    adapters: list[Adapter] = []
    for key in sorted(shapes):
        for down_sfx, up_sfx in _PAIRS:
            if not key.endswith(down_sfx):
                continue
            module = key[: -len(down_sfx)]
            up = module + up_sfx
            if up not in shapes:
                raise LoraError(f"{source}: '{key}' has no matching '{up}'")
            dshape, ushape = tuple(shapes[key]), tuple(shapes[up])
            if len(dshape) != 2 or len(ushape) != 2 or dshape[0] != ushape[1]:
                raise LoraError(f"{source}: '{key}' {list(dshape)} and '{up}' "
                                       f"{list(ushape)} are not a rank-r pair [r, K], [N, r]")
            if not 1 <= dshape[0] <= MAX_LORA_RANK:
                raise LoraError(f"{source}: '{key}' has rank {dshape[0]}; a rank must be in "
                                f"1..{MAX_LORA_RANK} (h3quant.limits.MAX_LORA_RANK)")
            alpha = module + _ALPHA if module + _ALPHA in shapes else None
            if alpha is not None and tuple(shapes[alpha]) not in ((), (1,)):
                raise LoraError(f"{source}: '{alpha}' must be a scalar, "
                                       f"got shape {list(shapes[alpha])}")
            adapters.append(Adapter(module, key, up, alpha, dshape[0], _style_of(module)))
            used.update(k for k in (key, up, alpha) if k)
            break
    rest = sorted(k for k in shapes if k not in used)
    if rest:
        raise LoraError(f"{source}: key(s) that belong to no LoRA pair: "
                               f"{', '.join(rest[:6])}{' ...' if len(rest) > 6 else ''}")
    if not adapters:
        raise LoraError(f"{source}: no LoRA pairs (lora_down/lora_up, lora_A/lora_B)")
    return adapters


def _strip(module: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if module.startswith(p):
            return module[len(p):]
    return module


def _layer_index(base_shapes: dict[str, tuple[int, ...]]) -> tuple[str, dict[str, str]]:
    """The base's name prefix and its layer names without it (``blocks.0.attn.qkv_proj``)."""
    weights = [k[: -len(".weight")] for k in base_shapes if k.endswith(".weight")]
    prefix = ""
    for w in weights:
        if w.endswith("blocks.0.attn.qkv_proj") and not w.endswith("token_refiner.blocks.0.attn.qkv_proj"):
            prefix = w[: -len("blocks.0.attn.qkv_proj")]
            break
    return prefix, {w[len(prefix):]: w for w in weights if w.startswith(prefix)}


def resolve(adapters: list[Adapter], base_shapes: dict[str, tuple[int, ...]],
            source: str = "LoRA", skip_unmatched: bool = False) -> tuple[list[Target], list[str]]:
    """Map adapters onto ``base_shapes`` (the base's logical ``name -> [N, K]`` shapes).

    Returns the targets and the modules skipped (only with ``skip_unmatched``); otherwise any
    module that maps to no layer, or whose shape does not fit, is an error naming it.
    """
    _, index = _layer_index(base_shapes)
    layers = Layers(index)
    targets: list[Target] = []
    problems: list[str] = []
    for ad in adapters:
        name, part = LORA_STYLES[ad.style].layer(ad.module, layers)
        if name is None or name not in layers:
            problems.append(f"'{ad.module}' maps to no layer of the base")
            continue
        full = layers[name]
        shape = tuple(base_shapes[full + ".weight"])
        if len(shape) != 2:
            problems.append(f"'{ad.module}' targets '{full}' of shape {list(shape)}, not a matrix")
            continue
        n, k = shape
        row0, rows, swap = 0, n, part == "swiglu"
        if part in ("q", "k", "v"):
            if n % 3:
                problems.append(f"'{ad.module}': '{full}' has {n} rows, not 3 equal parts")
                continue
            rows = n // 3
            row0 = "qkv".index(part) * rows
        if swap and n % 2:
            problems.append(f"'{ad.module}': '{full}' has {n} rows, not 2 equal halves")
            continue
        targets.append(Target(ad, full, row0, rows, swap))
    if problems and not skip_unmatched:
        raise LoraError(f"{source}: {len(problems)} adapter(s) do not fit the base: "
                               + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else ""))
    refuse_overlaps(targets, source)
    return targets, problems


def refuse_overlaps(targets: list[Target], source: str = "LoRA") -> None:
    """One adapter, applied once: two adapters of one file that change the same rows of one
    layer (the same adapter under two key spellings, e.g. ComfyUI and bare or kohya keys, or a
    fused to_qkv beside a split to_q) are refused, naming both keys. ComfyUI's loader keeps one
    of them silently (its key map assigns each model weight once, the later spelling replacing
    the earlier), so neither merging both nor picking one would be what the file's author meant
    for sure."""
    by_layer: dict[str, list[Target]] = {}
    for t in targets:
        by_layer.setdefault(t.layer, []).append(t)
    clashes = []
    for layer, ts in by_layer.items():
        ts = sorted(ts, key=lambda t: (t.row0, t.adapter.module))
        for a, b in zip(ts, ts[1:]):
            if b.row0 < a.row0 + a.rows:
                clashes.append(f"'{a.adapter.module}' ({a.adapter.style}) and "
                               f"'{b.adapter.module}' ({b.adapter.style}) both change rows "
                               f"{b.row0}:{min(a.row0 + a.rows, b.row0 + b.rows)} of '{layer}'")
    if clashes:
        raise LoraError(f"{source}: {len(clashes)} layer(s) are targeted twice (the same "
                        "adapter under two key spellings?): " + "; ".join(clashes[:4])
                        + (" ..." if len(clashes) > 4 else "")
                        + ". Each adapter is applied once: keep one spelling in the file "
                        "(ComfyUI would silently use only one of them).")


def check_shapes(targets: list[Target], lora_shapes: dict[str, tuple[int, ...]],
                 base_shapes: dict[str, tuple[int, ...]], source: str = "LoRA") -> None:
    """Every adapter's A is [r, K] and B is [rows, r] for its target layer."""
    bad = []
    for t in targets:
        k = tuple(base_shapes[t.layer + ".weight"])[1]
        if tuple(lora_shapes[t.adapter.down])[1] != k or tuple(lora_shapes[t.adapter.up])[0] != t.rows:
            bad.append(f"'{t.adapter.module}' down {list(lora_shapes[t.adapter.down])} up "
                       f"{list(lora_shapes[t.adapter.up])} does not fit '{t.layer}' rows "
                       f"{t.row0}:{t.row0 + t.rows} of K={k}")
    if bad:
        raise LoraError(f"{source}: shape mismatch: " + "; ".join(bad[:6]))


def describe(adapters: list[Adapter]) -> dict:
    """Style, ranks and targets of a parsed LoRA file (for ``inspect``)."""
    styles = sorted({a.style for a in adapters})
    return {"styles": styles, "adapters": len(adapters),
            "ranks": sorted({a.rank for a in adapters}),
            "modules": [a.module for a in adapters]}
