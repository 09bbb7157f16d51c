"""Calibration: input statistics of a checkpoint's linears, and rounding that uses them.

``capture`` runs the H3 forward block by block over the user's own inputs and records, for
every DiT block linear, the second moment ``H = X^T X`` of its inputs and the mean magnitude of
each input channel (``stats``: the statistics file). ``gptq`` chooses a codec's codes with
GPTQ-class error feedback from ``H``, after the codec has chosen its scales, so the file format
(and so what ComfyUI loads) stays exactly as it is; only which codes are written changes.
``recorder`` saves the inputs of a running ComfyUI model as ``--inputs`` files.

Layering: above the formats and the runtime (it runs the forward and hands statistics to the
codecs' ``encode(..., calibration=)``), below the pipelines and the CLI.
"""

__all__ = ["capture", "fingerprint", "gptq", "meta", "recorder", "stats"]
