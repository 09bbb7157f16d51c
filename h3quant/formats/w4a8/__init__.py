"""``asym_w4a8_int8`` (W4A8): its spec (``spec``), codec (``codec``), tensor functions
(``tensors``), the chunk encoder (``encoder``) and the level tables (``codebook``)."""

from h3quant.formats.w4a8.codec import CODEC
from h3quant.formats.w4a8.spec import SPEC

__all__ = ["CODEC", "SPEC"]
