"""What marks a statistics file, torch-free: the header commands (``validate``, ``inspect``) tell
one from a checkpoint without importing torch."""

META_KEY = "h3quant.calibration"  # the header metadata key of a statistics file ('capture')
