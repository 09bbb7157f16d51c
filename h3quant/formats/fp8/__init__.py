"""fp8 layers with one fp32 scale per tensor: ``float8_e4m3fn`` and ``float8_e5m2``.

``SPEC``/``CODEC`` are e4m3 (``convert --to fp8``); ``FORMATS`` holds both (spec, codec) pairs
(e5m2: ``convert --to fp8-e5m2``). Importing this package never imports torch.
"""

from h3quant.formats.fp8.codec import CODEC, E4M3_CODEC, E5M2_CODEC
from h3quant.formats.fp8.spec import E4M3, E5M2, SPEC, SPECS

FORMATS = ((E4M3, E4M3_CODEC), (E5M2, E5M2_CODEC))

__all__ = ["CODEC", "E4M3_CODEC", "E5M2_CODEC", "FORMATS", "SPEC", "SPECS"]
