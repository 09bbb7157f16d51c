"""GGUF files (the container llama.cpp defined and ComfyUI-GGUF loads diffusion models from),
read through the ``gguf`` package from PyPI (``pip install 'h3quant[gguf]'``).

    from h3quant.formats.gguf import GgufFile, is_gguf
    with GgufFile("h3-Q4_K_M.gguf") as f:
        f.tensors["blocks.0.attn.qkv_proj.weight"].qtype     # "Q4_K"
        w = f.read("blocks.0.attn.qkv_proj.weight")           # float32 numpy, [N, K]

Every tensor type the package can dequantize is read (the K-quants included), through the
package's own ``gguf.quants.dequantize``. Names are ComfyUI's (``naming``). Importing this
package imports neither torch nor gguf.
"""

from h3quant.formats.gguf.naming import comfy_name
from h3quant.formats.gguf.reader import GGUF_MAGIC, GgufFile, GgufTensor, is_gguf

__all__ = ["GGUF_MAGIC", "GgufFile", "GgufTensor", "comfy_name", "is_gguf"]
