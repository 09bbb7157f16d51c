"""What h3quant knows about the MiniMax H3 model, torch-free: its topology (``topology``), the
source layouts its checkpoints come in (``layouts``: comfy, official, diffusers; the mapping
onto ComfyUI's names in ``naming``), LoRA key styles (``lora``) and the provenance h3quant
records in the files it writes (``provenance``). ``h3quant.formats`` never imports it."""
