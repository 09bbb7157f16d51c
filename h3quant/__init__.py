"""h3quant: read, validate, convert and verify quantized MiniMax H3 checkpoints."""

__version__ = "0.2.0"
