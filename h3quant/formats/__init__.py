"""On-disk formats: the safetensors container, markers, the per-format codecs and their registry.

Nothing here imports torch at import time; tensor work imports it on first use.
"""
