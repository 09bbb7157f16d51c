"""nvfp4: fp4 e2m1 weights with e4m3 block scales and an fp32 tensor scale (docs/FORMATS.md)."""

from h3quant.formats.nvfp4.spec import SPEC
from h3quant.formats.nvfp4.codec import CODEC

__all__ = ["CODEC", "SPEC"]
