"""Formats ComfyUI knows that h3quant has no codec for yet: their specs only (FORMATS.md 2-4).

validate would check their tensor sets (finding Q105 says h3quant cannot convert or run them);
convert and verify refuse them. A format that gets its own package (spec and codec) leaves this
list: today every format ComfyUI registers has one, so the list is empty. Torch-free.
"""

from __future__ import annotations

from h3quant.formats.spec import FormatSpec

SPECS: tuple[FormatSpec, ...] = ()
