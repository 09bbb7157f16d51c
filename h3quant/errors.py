"""The one exception tree of h3quant.

Every error carries structured fields (which file, which tensor, which rule) so the CLI can
print a specific message and map it to an exit code without a traceback.
"""

from __future__ import annotations

import os
import re

# C0 controls except tab, DEL, C1 controls, and the Unicode bidi / line-separator controls that
# can reorder or hide what a terminal shows.
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` safe to print on a terminal: control characters become ``\\xNN``/``\\uNNNN``."""
    def esc(m: re.Match) -> str:
        c = ord(m.group())
        return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"

    return _CONTROLS.sub(esc, text)


class H3QuantError(Exception):
    """Base class. ``code`` is a stable finding code (see ``h3quant.findings``) when one applies."""

    exit_code = 2

    def __init__(
        self,
        reason: str,
        *,
        path: str | os.PathLike | None = None,
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
            parts.append(escape_controls(self.path))
        if self.tensor:
            parts.append(f"tensor '{escape_controls(self.tensor)}'")
        prefix = ": ".join(parts)
        code = f"[{self.code}] " if self.code else ""
        reason = escape_controls(self.reason)
        return f"{prefix}: {code}{reason}" if prefix else f"{code}{reason}"


class ContainerError(H3QuantError):
    """The safetensors container (header, offsets, buffer, index) is malformed or unreadable."""


class MarkerError(H3QuantError):
    """A ``.comfy_quant`` marker or the header quantization metadata is broken."""


class FormatError(H3QuantError):
    """A layer's tensors do not match its quantization scheme (shapes, dtypes, divisibility)."""


class FindingError(FormatError):
    """The input breaks a format rule that ``validate`` reports as an error finding (its code is
    in ``code``); convert and verify refuse it the same way: exit 1, nothing written."""

    exit_code = 1


class MarkerFindingError(MarkerError, FindingError):
    """A marker finding (``M1xx``) that ``validate`` reports as an error, raised by a command
    that refuses the file for it (exit 1, like ``validate``)."""


class UnsupportedError(H3QuantError):
    """A known but unsupported format or configuration was requested or found."""


class LoraError(UnsupportedError):
    """A LoRA file that cannot be baked as given: keys that fit no layer, shapes that do not fit,
    adapter types h3quant does not implement. Exit 1: the input breaks a rule."""

    exit_code = 1


class ConvertError(H3QuantError):
    """A conversion cannot proceed (bad options, refused output path, failed layer)."""


class OutputError(H3QuantError):
    """An output path is refused (it is an input, another output, not a regular file, a foreign
    directory, exists without --overwrite) or appeared while the command ran."""


class UsageError(H3QuantError):
    """An option value is out of range or unavailable (exit 2, before any work)."""


class ClosedError(UsageError):
    """An object of the Python API (a model, a checkpoint) was used after ``close()``."""


class DeviceError(H3QuantError):
    """A device string is invalid or the device cannot run what was asked."""


class VerifyError(H3QuantError):
    """Verification could not be set up (missing layers, mismatched reference)."""


class TpError(H3QuantError):
    """Tensor parallel cannot be set up or a rank failed (clear reason, exit 2)."""
