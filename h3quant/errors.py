"""The one exception tree of h3quant.

Every error carries structured fields (which file, which tensor, which rule) so the CLI can
print a specific message and map it to an exit code without a traceback.
"""

from __future__ import annotations

from pathlib import Path


class H3QuantError(Exception):
    """Base class. ``code`` is a stable finding code (see ``h3quant.findings``) when one applies."""

    exit_code = 2

    def __init__(
        self,
        reason: str,
        *,
        path: str | Path | None = None,
        tensor: str | None = None,
        code: str | None = None,
    ) -> None:
        self.reason = reason
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.code = code
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = []
        if self.path:
            parts.append(self.path)
        if self.tensor:
            parts.append(f"tensor '{self.tensor}'")
        prefix = ": ".join(parts)
        code = f"[{self.code}] " if self.code else ""
        return f"{prefix}: {code}{self.reason}" if prefix else f"{code}{self.reason}"


class ContainerError(H3QuantError):
    """The safetensors container (header, offsets, buffer, index) is malformed or unreadable."""


class MarkerError(H3QuantError):
    """A ``.comfy_quant`` marker or the header quantization metadata is broken."""


class FormatError(H3QuantError):
    """A layer's tensors do not match its quantization scheme (shapes, dtypes, divisibility)."""


class UnsupportedError(H3QuantError):
    """A known but unsupported format or configuration was requested or found."""


class ConvertError(H3QuantError):
    """A conversion cannot proceed (bad options, refused output path, failed layer)."""


class OutputError(H3QuantError):
    """An output path is refused (it is an input, another output, not a regular file, a foreign
    directory, exists without --overwrite) or appeared while the command ran."""


class UsageError(H3QuantError):
    """An option value is out of range or unavailable (exit 2, before any work)."""


class DeviceError(H3QuantError):
    """A device string is invalid or the device cannot run what was asked."""


class VerifyError(H3QuantError):
    """Verification could not be set up (missing layers, mismatched reference)."""
