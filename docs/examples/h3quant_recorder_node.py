from h3quant.comfy import *  # noqa: F401,F403  (ComfyUI/custom_nodes/h3quant_nodes.py)
