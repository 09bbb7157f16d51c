"""Where a checkpoint is read: any input a user holds, opened for reading its tensors.

``open_source`` opens a safetensors file, shard index or directory as a ``Checkpoint`` and a
GGUF file as a ``GgufView`` (the same reading interface, dequantized in place);
``open_as_comfy`` gives any of them as ComfyUI's single file (official, diffusers and fp8
sources through a ``SourceView``); ``input_paths`` lists every file a source reads, which no
output may name. ``hf`` resolves an ``ORG/NAME[@REV][:SUBFOLDER]`` argument to its folder in
the local Hugging Face cache. The runtime's model and loader, convert, verify, plan, capture
and compare read their inputs through this package. Importing it never imports torch.
"""

from h3quant.sources.comfy_view import (
    CACHE_EXTRA,
    SourceView,
    adopt_mapping,
    build_target,
    decode_fp8,
    open_as_comfy,
)
from h3quant.sources.header import check_scale, has_config
from h3quant.sources.open import open_source
from h3quant.sources.paths import input_paths

__all__ = ["CACHE_EXTRA", "SourceView", "adopt_mapping", "build_target", "check_scale",
           "decode_fp8", "has_config", "input_paths", "open_as_comfy", "open_source"]
