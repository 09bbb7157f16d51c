"""``int8_tensorwise``: its spec (``spec``: marker, tensor set, header rules), its codec
(``codec``) and its tensor functions (``tensors``)."""

from h3quant.formats.int8.codec import CODEC
from h3quant.formats.int8.spec import SPEC

__all__ = ["CODEC", "SPEC"]
