"""A saved sensitivity pass (``plan --json``, reused by ``plan --from``), checked field by field.

A pass file is data from outside: every field is checked before any arithmetic uses it, so a
forged or damaged file (zero or negative signal, a unit no file has, a format h3quant does not
know, a block count past the limit, strings where numbers belong) is a usage error naming the
field, never a crash. Which checkpoint it belongs to is checked by ``pipelines.fingerprint``.
"""

from __future__ import annotations

import math
import re

from h3quant.errors import H3QuantError, UsageError
from h3quant.limits import MAX_BLOCKS

OUTPUTS = ("video", "audio")

_UNIT = re.compile(r"^blocks\.(\d{1,4})(?:\.(attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2))?$")
_MAX_BYTES = 1 << 50


def _bad(field: str, why: str) -> UsageError:
    return UsageError(f"not a sensitivity pass saved by 'h3quant plan --json': {field} {why}")


def _int(v, field: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(field, f"must be an integer in {lo}..{hi}, got {v!r:.40}")
    return v


def _float(v, field: str, *, lo: float | None = None, positive: bool = False,
           allow_inf: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise _bad(field, f"must be a number, got {type(v).__name__}")
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        raise _bad(field, f"must be a number, got {v!r:.40}") from None
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise _bad(field, f"must be finite, got {v!r:.40}")
    if positive and not x > 0:
        raise _bad(field, f"must be > 0, got {x:g}")
    if lo is not None and x < lo:
        raise _bad(field, f"must be >= {lo:g}, got {x:g}")
    return x


def _per_output(m, field: str, **kw) -> dict[str, float]:
    if not isinstance(m, dict) or set(OUTPUTS) - set(m):
        raise _bad(field, f"must map {', '.join(OUTPUTS)} to numbers")
    return {o: _float(m[o], f"{field}.{o}", **kw) for o in OUTPUTS}


def checked_pass(d, parse_candidates) -> dict:
    """The keyword arguments of ``Sensitivity`` from a parsed pass ``d`` (``UsageError`` naming
    the field if bad); ``units`` as keyword dicts of ``UnitResult``. ``parse_candidates`` checks
    the format names (``plan --formats``'s parser)."""
    if not isinstance(d, dict):
        raise _bad("the file", "must hold a JSON object")
    for key in ("path", "inputs", "formats", "per_layer", "blocks", "prefix", "signal", "units"):
        if key not in d:
            raise _bad(repr(key), "is missing")
    if not isinstance(d["formats"], list) or not all(isinstance(f, str) for f in d["formats"]):
        raise _bad("'formats'", "must be a list of format names")
    try:
        formats = [c.format for c in parse_candidates(",".join(d["formats"]))]
    except H3QuantError as exc:
        raise _bad("'formats'", f"is not a list of known formats ({exc.reason})") from None
    if not isinstance(d["per_layer"], bool):
        raise _bad("'per_layer'", "must be true or false")
    blocks = _int(d["blocks"], "'blocks'", 1, MAX_BLOCKS)
    for key in ("path", "prefix"):
        if not isinstance(d[key], str):
            raise _bad(repr(key), "must be a string")
    if not isinstance(d["inputs"], dict):
        raise _bad("'inputs'", "must be an object")
    signal = _per_output(d["signal"], "'signal'", positive=True)
    units_in = d["units"]
    if not isinstance(units_in, list) or not units_in:
        raise _bad("'units'", "must be a non-empty list (no measurements)")
    units, seen = [], set()
    for i, u in enumerate(units_in):
        where = f"unit {i + 1}"
        if not isinstance(u, dict):
            raise _bad(where, "must be an object")
        missing = [k for k in ("unit", "block", "format", "bytes", "float_bytes", "noise",
                               "sqnr_db") if k not in u]
        if missing:
            raise _bad(where, f"lacks {', '.join(missing)}")
        name = u["unit"]
        m = (_UNIT.match(name[len(d["prefix"]):]) if isinstance(name, str)
             and name.startswith(d["prefix"]) else None)
        if m is None or (m.group(2) is None) == d["per_layer"]:
            raise _bad(where, f"names {name!r:.60}, not a {'linear' if d['per_layer'] else 'block'}"
                       " of an H3 block (blocks.N" + (".attn.qkv_proj ...)" if d["per_layer"]
                                                       else ")"))
        block = _int(u["block"], f"{where} 'block'", 0, MAX_BLOCKS - 1)
        if int(m.group(1)) != block:
            raise _bad(where, f"names block {m.group(1)} but records block {block}")
        if u["format"] not in formats:
            raise _bad(where, f"has format {u['format']!r:.40}, not one of the pass's "
                       f"formats ({', '.join(formats)})")
        if (name, u["format"]) in seen:
            raise _bad(where, f"repeats {name} in {u['format']}")
        seen.add((name, u["format"]))
        units.append(dict(
            unit=name, block=block, format=u["format"],
            bytes=_int(u["bytes"], f"{where} 'bytes'", 0, _MAX_BYTES),
            float_bytes=_int(u["float_bytes"], f"{where} 'float_bytes'", 0, _MAX_BYTES),
            noise=_per_output(u["noise"], f"{where} 'noise'", lo=0.0),
            sqnr_db=_per_output(u["sqnr_db"], f"{where} 'sqnr_db'", allow_inf=True)))
    seconds = d.get("seconds", 0.0)
    per_block = d.get("seconds_per_block", [])
    if not isinstance(per_block, list):
        raise _bad("'seconds_per_block'", "must be a list")
    measured_on = d.get("measured_on", {})
    if not isinstance(measured_on, dict):
        raise _bad("'measured_on'", "must be an object")
    return {"path": d["path"], "inputs": d["inputs"], "formats": formats,
            "per_layer": d["per_layer"], "blocks": blocks, "prefix": d["prefix"],
            "signal": signal, "units": units,
            "seconds": _float(seconds, "'seconds'", lo=0.0),
            "seconds_per_block": [_float(x, "'seconds_per_block'", lo=0.0) for x in per_block],
            "measured_on": measured_on}
