"""INT4 ConvRot (``convrot_w4a4``): signed int4 codes, fp32 row scales, ConvRot (docs/FORMATS.md)."""

from h3quant.formats.int4_convrot.spec import SPEC
from h3quant.formats.int4_convrot.codec import CODEC

__all__ = ["CODEC", "SPEC"]
