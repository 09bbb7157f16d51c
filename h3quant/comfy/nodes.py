"""The recorder node: a DIFFUSION_MODEL wrapper on a clone of the model, one run folder per use.

"H3Quant: record model inputs" goes between the model loader and the sampler. Each time
ComfyUI runs the node it makes a new recorder, whose first call creates its own run folder
(``<folder>/run_<UTC time>``) under ComfyUI's output directory (or the absolute ``folder``):
earlier recordings are never overwritten. Every call of the diffusion model (every sampler
step, conditional and unconditional) becomes one ``--inputs`` file with every argument the
call received (``calibration.recorder``), up to ``max_calls`` files or ``max_gigabytes``.
The sampler's own model is untouched and what the model computes never changes.
"""

from __future__ import annotations

import os

WRAPPER_KEY = "h3quant_record_inputs"


class H3QuantRecordInputs:
    """ComfyUI node: the model with its calls recorded."""

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
    DESCRIPTION = ("Records every call of the MiniMax H3 diffusion model as an inputs file for "
                   "'h3quant capture' and 'h3quant convert --calibrate-on', in a new folder "
                   "per run.")

    def patch(self, model, folder, max_calls, max_gigabytes):
        import comfy.patcher_extension
        import folder_paths

        from h3quant.calibration.recorder import InputsRecorder

        out_dir = folder if os.path.isabs(folder) else \
            os.path.join(folder_paths.get_output_directory(), folder)
        recorder = InputsRecorder(out_dir, max_calls=int(max_calls),
                                  max_bytes=int(max_gigabytes * (1 << 30)), log=print)
        kind = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL
        patched = model.clone()
        patched.remove_wrappers_with_key(kind, WRAPPER_KEY)  # re-applying replaces, never stacks
        patched.add_wrapper_with_key(kind, WRAPPER_KEY, recorder.diffusion_model_wrapper)
        return (patched,)


NODE_CLASS_MAPPINGS = {"H3QuantRecordInputs": H3QuantRecordInputs}
NODE_DISPLAY_NAME_MAPPINGS = {"H3QuantRecordInputs": "H3Quant: record model inputs"}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "H3QuantRecordInputs",
           "WRAPPER_KEY"]
