"""``int8_tensorwise_kn``, the NPU pre-transposed int8 layout: spec, codec and tensor functions
(built on ``h3quant.formats.int8``)."""

from h3quant.formats.int8_kn.codec import CODEC
from h3quant.formats.int8_kn.spec import SPEC

__all__ = ["CODEC", "SPEC"]
