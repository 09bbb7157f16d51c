"""GGUF tensor names -> ComfyUI's state-dict names.

ComfyUI-GGUF (city96, ``loader.py``) stores a diffusion model's tensors under the names of the
model's own state dict, the names ComfyUI's model code uses (``blocks.0.attn.qkv_proj.weight``
for H3), sometimes behind the ``model.diffusion_model.`` prefix of a full checkpoint, which
its loader strips when any tensor carries it. The shape of a tensor is the GGUF shape reversed
(GGUF lists the fastest-varying dimension first) unless a ``comfy.gguf.orig_shape.<name>``
field (an array of int32) gives the original one.
"""

from __future__ import annotations

DIFFUSION_PREFIX = "model.diffusion_model."
ORIG_SHAPE_FIELD = "comfy.gguf.orig_shape."


def comfy_name(name: str, has_prefix: bool) -> str | None:
    """The ComfyUI name of a GGUF tensor; None for a tensor outside the diffusion model (a file
    whose tensors carry the prefix keeps only those)."""
    if not has_prefix:
        return name
    return name[len(DIFFUSION_PREFIX):] if name.startswith(DIFFUSION_PREFIX) else None


def uses_prefix(names) -> bool:
    return any(n.startswith(DIFFUSION_PREFIX) for n in names)
