"""SVDQuant W4A4 (``svdquant_w4a4``): int4 codes with group scales, a low-rank branch and input
smoothing, in comfy-kitchen's natural layout; read only."""

from h3quant.formats.svdquant_w4a4.spec import SPEC
from h3quant.formats.svdquant_w4a4.codec import CODEC

__all__ = ["CODEC", "SPEC"]
