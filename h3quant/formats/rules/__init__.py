"""The rules under their earlier import path: ``from h3quant.formats import rules;
rules.layer_violations(...)`` keeps working. The rules are the formats' own
(``h3quant.formats.<format>.spec``), run by the one check engine ``h3quant.formats.check``."""

from h3quant.formats.check import (
    SCALE_DTYPES,
    Violation,
    combination_violations,
    fit_error,
    layer_violations,
    scale_violations,
    weight_violation,
)
from h3quant.formats.int8.spec import int8_scale_shapes
from h3quant.formats.w4a8.codebook import codebook_violation
from h3quant.formats.w4a8.spec import S_REL_DTYPES, w4a8_channel_shapes

__all__ = ["S_REL_DTYPES", "SCALE_DTYPES", "Violation", "codebook_violation",
           "combination_violations", "fit_error",
           "int8_scale_shapes", "layer_violations", "scale_violations", "w4a8_channel_shapes",
           "weight_violation"]
