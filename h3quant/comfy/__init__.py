"""h3quant's ComfyUI nodes: ``H3QuantRecordInputs`` records the MiniMax H3 model's inputs.

ComfyUI loads them from ``custom_nodes`` through a one-line file (``h3quant_nodes.py``)::

    from h3quant.comfy import *  # noqa: F401,F403

with h3quant installed in ComfyUI's own Python (the Windows portable build:
``python_embeded\\python.exe -m pip install h3quant``). Importing this package needs neither
ComfyUI nor torch; the node imports ComfyUI's modules when it runs. docs/calibration.md.
"""

from h3quant.comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
