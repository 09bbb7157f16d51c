"""The narrow codec: a format's tensor work (encode, decode, the runtime's weights).

A codec is built from its format's ``FormatSpec`` and only adds what needs tensors, grouped by
the engine that calls it, each group a small facet a format subclasses:

- ``decoder``: which stored tensors to read to decode rows, decoding them, the float weight
  (convert's decoder, ``validate --deep``, the runtime's float path);
- ``encoder``: encoding float rows (with an optional calibration object, for encoders that use
  one; in one call, or streamed in two passes), AWQ's channel scales, the report's dequantized
  weight (convert's encoder, calibration, the fresh encode);
- ``grid``: the int8 grid the int8 runtime multiplies, and what convert's relayout, verify's
  reference-free check, provenance and inspect ask about it;
- ``emulator``: the forward ComfyUI emulates where it has no kernel (the runtime, calibration);
- ``checks``: the rules on tensor values (convert, verify, ``validate --deep``).

Every switch about that work is the spec's, in the facet of the engine that reads it
(``spec.encoding.calibrates``, ``spec.runtime.decodes``, ``kernel``, ``emulation``,
``needs_row0`` ...), as are the header facts (name, targets, limits, planned tensors, the
tensors to transpose or to read for a grid ...): callers read them as
``codec.spec.<facet>.<field>``; a codec does not forward them. The spec's facets hold data and
header rules, the codec's facets tensor work: ``spec.encoding`` says how convert cuts a layer
into work, ``codec.encoder`` does the work. Importing a codec never imports torch; its methods
do, on first use.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from h3quant.errors import UnsupportedError
from h3quant.formats.spec import FormatSpec, RowRange, Violation

if TYPE_CHECKING:
    import torch


class CodecFacet:
    """A facet of a codec's tensor work a format may override (subclass the facet, pass an
    instance to ``Codec``). The codec binds its own copy of the facet when it is made, so a
    method reads its format's spec as ``self.spec``."""

    spec: FormatSpec


class Decoder(CodecFacet):
    """Decoding stored tensors back to float rows (convert's decoder, ``validate --deep``,
    plan's sensitivity) and the whole float weight (the runtime's float path)."""

    if TYPE_CHECKING:  # defined by the decoders of formats the runtime runs decoded
        def decode_weight(self, tensors: dict, fields: dict | None,
                          dtype: torch.dtype) -> torch.Tensor: ...

    def source_tensors(self, fields: dict | None, tensors: dict) -> tuple[list[str], list[str]]:
        """(suffixes read row by row, suffixes read whole) to decode rows of a stored weight."""
        return ["weight"], []

    def row_views(self, whole: dict, fields: dict | None) -> dict[str, torch.Tensor]:
        """Row-indexed tensors derived once from the whole-read ones (nvfp4: its block scales
        unswizzled to ``[N, K/16]``); ``decode_rows`` gets their rows under the same names."""
        return {}

    def decode_rows(self, rows: dict, whole: dict, fields: dict | None) -> torch.Tensor:
        """Rows of the weight in the original basis (fp32 for quantized formats)."""
        return rows["weight"]


class Encoder(CodecFacet):
    """Encoding float rows into the format's tensors (convert's encoder, calibration, the fresh
    encode), in one call or streamed in two passes, and the report's view of the result."""

    def channel_scale(self, w: torch.Tensor, marker: dict | None, calibration
                      ) -> tuple[torch.Tensor | None, Any, dict]:
        """(``s`` fp32 [K] or None for no scaling, the statistics of the scaled inputs ``x / s``
        to encode ``W diag(s)`` with (None with no scaling), a report entry) for the float
        weight ``w`` with the layer's statistics; only called when ``spec.encoding.scales_channels``."""
        return None, None, {}

    def encode(self, w: torch.Tensor, marker: dict | None, method: str, pool=None,
               calibration=None) -> dict[str, torch.Tensor]:
        """Encode float rows ``w`` [n, K] into this format's tensors (marker tensor aside).

        ``pool``: an executor a whole-layer codec (``spec.encoding.chunked`` false) may spread its row
        chunks over; row-chunked codecs are called per chunk and ignore it. ``calibration``: an
        object an encoder that uses activation statistics is handed (None: none given)."""
        import torch

        return {"weight": w.to(torch.bfloat16)}

    def scan_rows(self, w: torch.Tensor) -> Any:
        """A streamed codec's first pass (``spec.encoding.streamed``): what rows ``w`` contribute to the
        layer-wide value (None: the codec needs none)."""
        return None

    def layer_value(self, parts: list) -> Any:
        """The layer-wide value from every chunk's ``scan_rows`` (None: none needed)."""
        return None

    def encode_rows(self, w: torch.Tensor, marker: dict | None, method: str,
                    value: Any) -> dict[str, torch.Tensor]:
        """A streamed codec's second pass: rows ``w`` (a chunk of ``spec.encoding.chunk_rows`` multiples
        starting at such a multiple) encoded with the layer-wide ``value``. Every output but a
        0-dim one holds the chunk's stored rows (the last chunk's padding rows included); the
        bytes equal the same rows of ``encode`` on the whole layer."""
        return self.encode(w, marker, method)

    def report_grid(self, out: dict, marker: dict | None):
        """(dequantized weight fp32, int8 grid ``(q, s, convrot, g)`` or None) of encoded ``out``."""
        return out["weight"].float(), None


class Grid(CodecFacet):
    """The int8 grid the int8 runtime multiplies, and what the engines ask about it: convert's
    relayout through a decoded grid, verify's reference-free check, provenance, inspect."""

    def int8_grid(self, tensors: dict, fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [N, K], fp32 per-row scales [N]) the int8 runtime multiplies."""
        raise NotImplementedError(f"{self.spec.name} layers have no int8 grid")

    def grid_rows(self, rows: dict, whole: dict, fields: dict) -> torch.Tensor:
        """int8 codes of rows of a format whose spec names a ``grid_scale`` (its decoded grid)."""
        raise NotImplementedError(f"{self.spec.name} layers have no int8 grid of their own")

    def runtime_weights(self, tensors: dict, grid: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes, fp32 scale) a runtime linear is built from, given the layer's int8 grid."""
        return grid

    def grid_origin(self, q: torch.Tensor) -> str | None:
        """Whether int8 codes ``q`` [n, K] (rows of another layer) lie exactly on this format's
        decoded int8 grid, as a layer converted from this format keeps them: a short description
        of that grid (its table, its group), or None."""
        return None

    def row_range(self, tensors: dict, th) -> RowRange:
        """verify's reference-free check of the int8 grid: the legal per-row code peak."""
        return RowRange(per_tensor=False, low=127, high=127, no_min128=True, text="max|q| = 127 per row")

    def nz_eligible(self, n: int, k: int) -> bool | None:
        """Whether the layer's weight can run in the NPU's NZ layout (None: not a question)."""
        return None


class DecodedGrid(Grid):
    """A format the runtime runs through its float decode: it has no int8 grid."""

    def int8_grid(self, tensors, fields):
        """No int8 grid: the runtime runs these layers through ``decode_weight`` (dequant)."""
        raise UnsupportedError(f"{self.spec.name} layers have no int8 grid; the runtime runs "
                               "them through their float decode (dequant)", code="Q105")


class Emulator(CodecFacet):
    """The forward ComfyUI computes where it emulates the format (the runtime, calibration)."""

    def emulated_linear(self, x: torch.Tensor, tensors: dict, fields: dict | None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` as ComfyUI computes it on the devices ``spec.runtime.emulation`` names."""
        raise NotImplementedError(f"{self.spec.name} layers have no emulated forward")


class Checks(CodecFacet):
    """The rules on tensor values (convert, verify, ``validate --deep``)."""

    def data_violation(self, suffix: str, values: torch.Tensor) -> Violation | None:
        """The rule on the values of a ``spec.verify.deep_whole`` tensor (None: they pass)."""
        return None

    def layer_data_violations(self, tensors: dict, read, fields: dict) -> list[Violation]:
        """``validate --deep`` rules over several tensors of one layer (nvfp4: block scales
        against codes); ``read(info, dtype=None)`` gives a tensor's values, 1-D."""
        return []


# the codec's facets and their defaults (a plain float layer's tensor work)
CODEC_FACETS: dict[str, type[CodecFacet]] = {"decoder": Decoder, "encoder": Encoder,
                                             "grid": Grid, "emulator": Emulator, "checks": Checks}


class Codec:
    """Tensor work of one format: its spec and one object per facet (``decoder``, ``encoder``,
    ``grid``, ``emulator``, ``checks``); a facet not given is the plain float layer's."""

    decoder: Decoder
    encoder: Encoder
    grid: Grid
    emulator: Emulator
    checks: Checks

    def __init__(self, spec: FormatSpec, *, decoder: Decoder | None = None,
                 encoder: Encoder | None = None, grid: Grid | None = None,
                 emulator: Emulator | None = None, checks: Checks | None = None) -> None:
        self.spec = spec
        given = {"decoder": decoder, "encoder": encoder, "grid": grid, "emulator": emulator,
                 "checks": checks}
        for name, default in CODEC_FACETS.items():  # each codec binds its own copy
            chosen = given[name]
            facet: CodecFacet = copy.copy(chosen) if chosen is not None else default()
            facet.spec = spec
            setattr(self, name, facet)

    def __repr__(self) -> str:
        return f"<codec {self.spec.name}>"
