"""A ComfyUI custom node that records the MiniMax H3 model's inputs for 'h3quant capture'.

Install: copy this file into ComfyUI/custom_nodes/ (h3quant must be importable from ComfyUI's
Python: ``pip install h3quant`` in that environment). In a workflow, put "H3Quant: record model
inputs" between the model loader and the sampler and run your usual generations: every call of
the diffusion model (every sampler step, conditional and unconditional) is saved as one
``--inputs`` file in the chosen folder, up to ``max_calls`` files or ``max_gigabytes`` in all.
Then, outside ComfyUI:

    h3quant capture h3.safetensors --inputs recorded/*.safetensors --out h3.stats
    h3quant convert h3.safetensors h3_w4a8.safetensors --to w4a8 --calibration h3.stats

The node adds a DIFFUSION_MODEL wrapper to a clone of the model (the sampler's own model is
untouched) and never changes what the model computes.
"""

import os

import comfy.patcher_extension
import folder_paths

from h3quant.calibration.recorder import InputsRecorder

WRAPPER_KEY = "h3quant_record_inputs"


class H3QuantRecordInputs:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "folder": ("STRING", {"default": "h3quant_inputs"}),
            "max_calls": ("INT", {"default": 64, "min": 1, "max": 4096}),
            "max_gigabytes": ("FLOAT", {"default": 8.0, "min": 0.1, "max": 1024.0}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "advanced/h3quant"

    def patch(self, model, folder, max_calls, max_gigabytes):
        out_dir = folder if os.path.isabs(folder) else \
            os.path.join(folder_paths.get_output_directory(), folder)
        recorder = InputsRecorder(out_dir, max_calls=int(max_calls),
                                  max_bytes=int(max_gigabytes * (1 << 30)), log=print)
        patched = model.clone()
        patched.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                         WRAPPER_KEY)
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                     WRAPPER_KEY, recorder.diffusion_model_wrapper)
        return (patched,)


NODE_CLASS_MAPPINGS = {"H3QuantRecordInputs": H3QuantRecordInputs}
NODE_DISPLAY_NAME_MAPPINGS = {"H3QuantRecordInputs": "H3Quant: record model inputs"}
