"""The file behind a view that computes its tensors (a GGUF file dequantized in place, a source
layout mapped to ComfyUI's names): the attributes a reader of a ``SafetensorsFile`` expects,
answered from the view."""

from __future__ import annotations

from pathlib import Path


class VirtualFile:
    """One file of a view: its ``path``, no findings of its own, the view's ``metadata``."""

    def __init__(self, view, path: Path):
        self.view = view
        self.path = path
        self.findings: list = []

    @property
    def metadata(self) -> dict[str, str]:
        return self.view.metadata
