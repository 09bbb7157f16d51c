"""The plain floating-point layer: no marker, any float weight (BF16 / F16 / F32)."""

from __future__ import annotations

from h3quant.formats.spec import FormatSpec, ReadingFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet
from h3quant.formats.spec import BIAS, FLOATS, TensorSpec, Target

NAME = "float"


class PlainReading(ReadingFacet):
    """reading."""

    def describe(self, fields):
        return "BF16"


SPEC = FormatSpec(
    name=NAME,
    description="unquantized floating-point layer (BF16 / F16 / F32)",
    quantized=False,
    storage=StorageFacet(
        tensors=(TensorSpec("weight", FLOATS, None, "any"), BIAS),
        closed=False,
    ),
    encoding=EncodingFacet(
        targets=(Target("bf16", NAME, False, "dequantize quantized layers back to BF16"),),
    ),
    runtime=RuntimeFacet(
        tensors=("weight",),
        required=("weight",),
    ),
    reading=PlainReading(),
)
