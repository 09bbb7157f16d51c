"""The layer scan ``inspect`` and ``validate`` share: markers resolved from the header or from
the marker tensors, counting what is read."""

from __future__ import annotations

from h3quant.errors import MarkerError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_layers
from h3quant.formats.markers import layer_of_marker, marker_bytes, parse_header_metadata

MAX_MARKER_BYTES = 1 << 20  # a marker is ~100 bytes; never pull a forged giant one into memory


class MarkerReader:
    """``read_bytes(name)`` for ``scan_layers`` that counts what it reads.

    With ``prefer_header`` a layer described by the header metadata gets the header's fields
    (ComfyUI's view, no I/O); otherwise the marker tensor is read (at most MAX_MARKER_BYTES).
    """

    def __init__(self, ckpt: Checkpoint, *, prefer_header: bool):
        self.ckpt = ckpt
        self.bytes_read = 0
        self.header = None
        if prefer_header:
            try:
                self.header = parse_header_metadata(ckpt.metadata)
            except MarkerError:
                self.header = None

    def __call__(self, name: str) -> bytes:
        layer = layer_of_marker(name)
        if self.header is not None and layer in self.header:
            return marker_bytes(self.header[layer])
        info = self.ckpt.info(name)
        length = min(info.nbytes, MAX_MARKER_BYTES)
        data = bytes(self.ckpt.file_of(name).read_bytes(info, 0, length)) if length else b""
        self.bytes_read += len(data)
        return data


def scan(ckpt: Checkpoint, *, prefer_header: bool):
    """(LayerScan, MarkerReader) for an open checkpoint."""
    reader = MarkerReader(ckpt, prefer_header=prefer_header)
    return scan_layers(ckpt.tensors, ckpt.metadata, reader, file=str(ckpt.path)), reader
