"""Plain floating-point layers (no marker): what ``convert --to bf16`` writes."""

from h3quant.formats.plain.codec import CODEC
from h3quant.formats.plain.spec import SPEC

__all__ = ["CODEC", "SPEC"]
