"""Plain floating-point layers (no marker): what ``convert --to bf16`` writes."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, Target

NAME = "float"


class PlainFloat(Codec):
    name = NAME
    quantized = False
    description = "unquantized floating-point layer (BF16 / F16 / F32)"
    targets = (Target("bf16", NAME, False, "dequantize quantized layers back to BF16"),)
    runtime_tensors = ("weight",)
    runtime_required = ("weight",)

    def describe(self, fields):
        return "BF16"


CODEC = PlainFloat()
