"""fp8 layers with one fp32 scale per tensor: ``float8_e4m3fn`` and ``float8_e5m2``.

``SPEC``/``CODEC`` are e4m3 (``convert --to fp8``); ``SPECS``/``CODECS`` hold both formats
(e5m2: ``convert --to fp8-e5m2``). Importing this package never imports torch.
"""

from h3quant.formats.fp8.codec import CODEC, CODECS, E4M3_CODEC, E5M2_CODEC
from h3quant.formats.fp8.spec import E4M3 as SPEC
from h3quant.formats.fp8.spec import SPECS

__all__ = ["CODEC", "CODECS", "E4M3_CODEC", "E5M2_CODEC", "SPEC", "SPECS"]
