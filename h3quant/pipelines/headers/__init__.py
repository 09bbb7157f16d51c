"""The header commands, torch-free: ``inspect`` and ``validate`` of a checkpoint (``inspect``,
``validate``, with ``layer_scan`` grouping its layers and reading their markers), of a LoRA file
(``lora_inspect``) and of a GGUF file (``gguf``), and the checkpoint's naming (``naming``).
They read headers and the tiny marker tensors only; torch is imported only where ``--deep``
reads tensor data."""
