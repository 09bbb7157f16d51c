"""AWQ W4A16 (``awq_w4a16``): unsigned int4 codes with group scales and zero points."""

from h3quant.formats.awq_w4a16.spec import SPEC
from h3quant.formats.awq_w4a16.codec import CODEC

__all__ = ["CODEC", "SPEC"]
