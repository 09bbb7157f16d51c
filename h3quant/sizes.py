"""One size style for people: decimal GB from 1 GB up, MB below, two decimals.

``20_970_000_000 -> '20.97 GB'``, ``33_512_345 -> '33.51 MB'``. Machines read bytes: every size
in a ``--json`` document is an integer count of bytes, never a rounded figure.
"""

from __future__ import annotations

import re

MB = 1000**2
GB = 1000**3


def size_text(n: int) -> str:
    """A size in text: ``'20.97 GB'`` or ``'33.51 MB'`` (decimal units, two decimals); a size
    that rounds to 1000.00 MB is ``'1.00 GB'``, a non-empty one under 0.005 MB ``'<0.01 MB'``."""
    if round(n / MB, 2) >= 1000:
        return f"{n / GB:,.2f} GB"
    if 0 < n < MB // 200:
        return "<0.01 MB"
    return f"{n / MB:,.2f} MB"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """``800MB``, ``1.5GB``, ``2GiB``, ``123456`` -> bytes (decimal units; ``i``: binary);
    ValueError saying what a size looks like otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 800MB, 1.5GB, 2GiB, 123456)")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    return int(value * (1024 if binary else 1000) ** power)


def mb_number(n: int) -> str:
    """A size in a table column headed ``MB``: the bare number, two decimals."""
    return f"{n / MB:,.2f}"
