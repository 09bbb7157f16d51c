"""``mxfp8``: e4m3 codes with an e8m0 scale per 32 values (``convert --to mxfp8``).

Importing this package never imports torch."""

from h3quant.formats.mxfp8.codec import CODEC
from h3quant.formats.mxfp8.spec import SPEC

__all__ = ["CODEC", "SPEC"]
