"""The ``h3quant.from_w4a8`` header key: which int8 layers were converted from W4A8 layers.

An int8 layer made from a W4A8 layer carries W4A8's error, not int8's, so ``verify`` judges it by
W4A8's limits. ``convert`` records such layers in the file's header metadata (a JSON list of
layer names, sorted); ComfyUI reads only ``_quantization_metadata`` and ignores this key.
Torch-free: convert's planning writes it before torch is imported.

Also the ``h3quant.awq_channel_scaling`` key (``SCALING_KEY``): the layers stored with AWQ's
per-input-channel scaling, each mapped to the layer whose output rows carry the division (a
JSON object, consumer: predecessor); alone, neither layer equals its float original.
"""

from __future__ import annotations

import json

from h3quant.formats import registry

KEY = "h3quant.from_w4a8"
# The format the key is about: the one whose decoded weights lie on an int8 grid (W4A8).
W4A8 = next(s.name for s in registry.specs() if s.relayout.grid_scale is not None)
SCALING_KEY = "h3quant.awq_channel_scaling"
# The layers ``convert --smooth auto`` stored as W diag(s), the division folded into the
# tensors before them (a JSON list, sorted): alone, such a layer differs from its float original.
SMOOTHING_KEY = "h3quant.smoothing"


def read_scaling(metadata: dict[str, str] | None) -> dict[str, str]:
    """``{consumer: predecessor}`` from the header (empty when absent or malformed)."""
    raw = (metadata or {}).get(SCALING_KEY)
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def is_int8(fmt: str | None) -> bool:
    """An int8 format (either layout): its weight holds int8 codes."""
    spec = registry.spec(fmt) if fmt else None
    return spec is not None and spec.relayout.int8_codes


def read(metadata: dict[str, str] | None, key: str = KEY) -> set[str]:
    """The layer names the header records under ``key`` (converted from W4A8, by default;
    ``SMOOTHING_KEY``: smoothed), empty when absent or malformed."""
    raw = (metadata or {}).get(key)
    if not raw:
        return set()
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return set()
    if not isinstance(value, list):
        return set()
    return {v for v in value if isinstance(v, str)}


def value(names: set[str]) -> str:
    return json.dumps(sorted(names))


def carried(before: set[str], layer: str, action: str, via: str, src_format: str | None,
            out_format: str | None) -> bool:
    """Whether output layer ``layer`` is still "from W4A8" after one conversion step.

    A W4A8 layer converted to an int8 format is (whatever route: its decoded grid or a
    re-encoding of its decoded weights); an int8 layer that only changed layout, or was copied
    or kept as it is, stays what it was; anything encoded afresh is not."""
    if action != "convert":
        return layer in before
    if not is_int8(out_format):
        return False
    if src_format == W4A8:
        return True
    return via == "relayout" and layer in before
