"""The format contract as rules: markers and header metadata (``markers``), each format's tensor set
(``schemes``), layers (``layers``), the H3 topology (``topology``), the data checks of
``validate --deep`` (``deep``) and the one rule set all commands share (``checks``, re-exported
here: ``from h3quant.formats import rules; rules.layer_violations(...)``)."""

from h3quant.formats.rules.checks import (
    S_REL_DTYPES,
    SCALE_DTYPES,
    Violation,
    codebook_violation,
    combination_violations,
    fit_error,
    int8_scale_shapes,
    layer_violations,
    scale_violations,
    w4a8_channel_shapes,
    weight_violation,
)

__all__ = ["S_REL_DTYPES", "SCALE_DTYPES", "Violation", "codebook_violation",
           "combination_violations", "fit_error",
           "int8_scale_shapes", "layer_violations", "scale_violations", "w4a8_channel_shapes",
           "weight_violation"]
