"""LoRA files: recognise the key style and map each adapter to the H3 layer rows it changes.

Torch-free: works on tensor names and shapes only. ``parse`` groups a LoRA file's keys into
adapters (one ``down``/``up`` pair and an optional ``alpha`` per module); ``resolve`` maps each
adapter onto a layer of a base checkpoint and the row range it writes (a split ``to_q``/``to_k``/
``to_v`` adapter writes one third of the fused ``attn.qkv_proj`` rows; a diffusers SwiGLU
``ff.net.0.proj`` adapter is ``[value; gate]`` and lands swapped in the ``[gate | up]`` fc1).
Bad input is an ``UnsupportedError`` that names the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.errors import LoraError
from h3quant.h3.naming import diffusers_to_comfy

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
# The key styles, each with what it looks like (the CLI's choices and help read this).
STYLE_HELP = {
    "comfyui": "ComfyUI / musubi-tuner (diffusion_model. prefix, lora_down / lora_up, alpha)",
    "kohya": "kohya (lora_unet_blocks_0_attn_qkv_proj)",
    "diffusers": "diffusers / PEFT (split to_q/to_k/to_v, SwiGLU [value; gate])",
}
STYLES = tuple(STYLE_HELP)


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


def _style_of(module: str) -> str:
    if module.startswith(_KOHYA_PREFIX):
        return "kohya"
    if module.startswith(_COMFY_PREFIXES):
        return "comfyui"
    if module.startswith(_DIFFUSERS_PREFIXES):
        return "diffusers"
    tail = module.split("blocks.", 1)[-1]
    return "diffusers" if any(tail.endswith("." + d) for d in DIFFUSERS_NAMES) else "comfyui"


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
    _, layers = _layer_index(base_shapes)
    kohya = {name.replace(".", "_"): name for name in layers}
    targets: list[Target] = []
    problems: list[str] = []
    for ad in adapters:
        part = None
        if ad.style == "kohya":
            name = kohya.get(ad.module[len(_KOHYA_PREFIX):])
        elif ad.style == "comfyui":
            name = _strip(ad.module, _COMFY_PREFIXES)
        else:
            stem = _strip(ad.module, _DIFFUSERS_PREFIXES)
            for dname, (h3, p) in DIFFUSERS_NAMES.items():
                if stem.endswith("." + dname):
                    stem, part = stem[: -len(dname)] + h3, p
                    break
            # diffusers module names (transformer_blocks.N, proj_in, norm_out, ...) -> ComfyUI's
            name = diffusers_to_comfy(stem + ".weight")[: -len(".weight")]
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
    return targets, problems


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
