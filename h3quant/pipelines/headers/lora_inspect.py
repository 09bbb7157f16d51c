"""Recognise a LoRA file and summarise it: key style, ranks, alphas, and the H3 layers it touches.

Reads the safetensors header and the scalar ``alpha`` tensors only. The H3 layers are named
against the full-size H3 topology (as many blocks as the file names).
"""

from __future__ import annotations

import re
from pathlib import Path

from h3quant.errors import H3QuantError, LoraError, UnsupportedError
from h3quant.formats.container.dtypes import float_value
from h3quant.h3 import lora as lora_keys
from h3quant.h3.topology import config_for, expected_tensors

_PAIR_HINT = re.compile(r"\.(lora_(down|up|A|B)|lora\.(down|up)|hada_|lokr_)")


def _header(path: str):
    """The file's safetensors header (our own reader: no torch import for inspect)."""
    from h3quant.formats.container.reader import SafetensorsFile

    return SafetensorsFile(path, mmap=False, strict=False)


def looks_like_lora(path: str) -> bool:
    """True for a single .safetensors file whose keys are LoRA adapter keys."""
    p = Path(path)
    if not (p.is_file() and p.name.endswith(".safetensors")):
        return False
    try:
        sf = _header(path)
    except H3QuantError:  # not readable as safetensors: the checkpoint inspector reports it
        return False
    try:
        keys = list(sf.tensors)
    finally:
        sf.close()
    return bool(keys) and sum(bool(_PAIR_HINT.search(k)) for k in keys) * 2 >= len(keys)


def _scalar(sf, name: str) -> float:
    info = sf.tensors[name]
    value = float_value(bytes(sf.read_bytes(info)), info.dtype)
    if value is None:
        raise LoraError(f"LoRA '{sf.path}': alpha '{name}' is {info.dtype}, not a float")
    return value


def inspect_lora(path: str) -> dict:
    sf = _header(path)
    try:
        shapes = {k: tuple(t.shape) for k, t in sf.tensors.items()}
        adapters = lora_keys.parse(shapes, source=f"LoRA '{path}'")
        alphas = {a.alpha: _scalar(sf, a.alpha) for a in adapters if a.alpha}
    finally:
        sf.close()
    idx = [int(m.group(1)) for a in adapters
           for m in [re.search(r"(?<!refiner[._])blocks[._](\d+)[._]", a.module)] if m]
    fits, first = None, None
    for preset in ("full", "tiny"):  # named against the full-size H3; dims checked for both
        cfg = config_for(preset, blocks=max(idx, default=0) + 1)
        shapes_of = {k: s for k, (_, s) in expected_tensors(cfg).items()}
        found, missed = lora_keys.resolve(adapters, shapes_of, f"LoRA '{path}'",
                                          skip_unmatched=True)
        if first is None:
            base, targets, unmatched = shapes_of, found, missed
        try:
            lora_keys.check_shapes(found, shapes, shapes_of, f"LoRA '{path}'")
            fits = f"fit the {preset} H3 preset"
            base, targets, unmatched = shapes_of, found, missed
            break
        except UnsupportedError as exc:
            first = first or str(exc)
    fits = fits or first
    info = lora_keys.describe(adapters)
    info.update({
        "file": path,
        "alphas": sorted({alphas[a.alpha] for a in adapters if a.alpha}),
        "layers": sorted({_where(t, base) for t in targets}),
        "unmatched": unmatched,
        "shapes": fits,
    })
    return info


def _where(t: lora_keys.Target, base: dict) -> str:
    if t.swap:
        return f"{t.layer} (halves swapped: [value; gate] -> [gate | up])"
    if t.rows != base[t.layer + ".weight"][0]:
        return f"{t.layer} rows {t.row0}:{t.row0 + t.rows}"
    return t.layer


def render_lora(info: dict) -> str:
    lines = [f"LoRA file: {info['file']}",
             f"  style(s): {', '.join(info['styles'])}; adapters: {info['adapters']}; "
             f"rank(s): {', '.join(map(str, info['ranks']))}; "
             f"alpha(s): {', '.join(f'{a:g}' for a in info['alphas']) or 'none (alpha = rank)'}",
             f"  shapes: {info['shapes']}",
             f"  H3 layers touched ({len(info['layers'])}):"]
    lines += [f"    {name}" for name in info["layers"]]
    if info["unmatched"]:
        lines.append(f"  unmatched ({len(info['unmatched'])}):")
        lines += [f"    {u}" for u in info["unmatched"]]
    return "\n".join(lines)
