"""What a file that is not safetensors is, from its first bytes, for the error that refuses it:
a PyTorch pickle (``torch.save``'s zip archive or its older bare pickle stream, the
``.pt`` / ``.pth`` / ``.ckpt`` files), or a file named ``.gguf`` without the GGUF magic. A raw
"header length" of such a file tells a user nothing."""

from __future__ import annotations

import os

_ADVICE = ("h3quant reads safetensors and GGUF files only; a pickle can run code when loaded, "
           "so load it only if you trust it (torch.load) and save its tensors with "
           "safetensors.torch.save_file")


def describe(path: str | os.PathLike) -> str | None:
    """A sentence naming what ``path`` is when its first bytes show it is not safetensors
    (None: nothing recognised, or unreadable)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return None
    name = os.fspath(path).lower()
    if head[:4] == b"PK\x03\x04":
        return ("not a safetensors file: it is a zip archive, as PyTorch's torch.save writes "
                f"(.pt / .pth / .ckpt), holding a pickle; {_ADVICE}")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return (f"not a safetensors file: it is a Python pickle (protocol {head[1]}), as older "
                f"PyTorch torch.save writes (.pt / .pth / .ckpt); {_ADVICE}")
    if name.endswith(".gguf") and head[:4] != b"GGUF":
        return (f"not a GGUF file: it is named .gguf but begins with {head[:4]!r}, where a GGUF "
                "file begins with the magic b'GGUF' (a partial download or another format)")
    return None
