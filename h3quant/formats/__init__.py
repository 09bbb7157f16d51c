"""On-disk formats: the safetensors container (``container``), one package per layer format
(``int8``, ``int8_kn``, ``w4a8``, ``plain``: spec, codec, tensor functions), the one registry
(``registry``) and the engines that iterate it (``markers``, ``layers``, ``check``, ``deep``,
``report``). Nothing here knows H3 (``h3quant.h3``) or devices.

Nothing here imports torch at import time; tensor work imports it on first use.
"""
