"""``compare``: which of several H3 files is good? A quality card, side by side, on one device.

Every file runs the real H3 forward (``runtime.model.H3Model``, streamed block by block) on the
same seeded inputs as a reference file, and the same initial noise through the same
flow-matching Euler sampler. Reported per file: the output SQNR (video and audio apart), the
drift after every block (and each block alone, on the reference's own input: it points at a
broken block), the final latent's SQNR / PSNR after N sampler steps and the drift after every
step, the size, bits per weight, the mix of formats and the time per sampler step. The
reference's activations are computed once and reused for every file (docs/compare.md).

The entry points are importable from here (loaded on first use: importing the package does not
import torch)::

    from h3quant.pipelines.compare import CompareOptions, compare_files
"""

_EXPORTS = {
    "CompareOptions": "run", "compare_files": "run",
    "CompareResult": "card", "FileCard": "card",
    "FileFacts": "facts", "file_facts": "facts", "pick_reference": "facts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"h3quant.pipelines.compare.{_EXPORTS[name]}"),
                       name)
    raise AttributeError(f"module 'h3quant.pipelines.compare' has no attribute {name!r}")
