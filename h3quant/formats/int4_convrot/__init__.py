"""INT4 ConvRot (``convrot_w4a4``): signed int4 codes, fp32 row scales, ConvRot (docs/FORMATS.md).
Also reads ``int4_tensorwise``, a ComfyUI fork's name for the same layout (never written)."""

from h3quant.formats.int4_convrot.spec import ALIAS_SPEC, SPEC
from h3quant.formats.int4_convrot.codec import ALIAS_CODEC, CODEC

FORMATS = ((SPEC, CODEC), (ALIAS_SPEC, ALIAS_CODEC))

__all__ = ["ALIAS_CODEC", "ALIAS_SPEC", "CODEC", "FORMATS", "SPEC"]
