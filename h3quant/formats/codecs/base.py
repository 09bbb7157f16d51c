"""What every layer-format codec provides, and the defaults most of them share.

A codec is the single place that knows one on-disk format: its marker name and defaults, its
tensor set, how many logical input columns a stored column holds, the ``convert --to`` targets
that write it, how to encode float rows into it and decode them back, what the runtime
multiplies (the int8 grid), which tensors carry scales the deep check reads, and the limits
``verify`` applies. Pipelines ask the registry for the codec of a layer instead of testing
format names. Importing a codec never imports torch; its tensor methods do, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Target:
    """A ``convert --to`` choice: the codec that writes it and its fixed parameters."""

    name: str
    codec: str
    convrot: bool
    help: str


@dataclass(frozen=True)
class RowRange:
    """Legal peak |code| of a quantized layer's int8 grid (per row, or one peak per tensor)."""

    per_tensor: bool
    low: int
    high: int
    no_min128: bool  # the encoder never writes -128
    text: str
    alt: RowRange | None = None  # accepted instead when every row fits it (a known other source)

    def misses(self, peak, qmin):
        """Rows (bool tensor) whose peak |q| or minimum code break the rule."""
        bad = (peak < self.low) | (peak > self.high)
        return bad | (qmin == -128) if self.no_min128 else bad


@dataclass(frozen=True)
class VerifyLimits:
    """``verify`` limits for layers of a format (block limits apply to the loosest format present)."""

    rel_err: float  # relative L2 error of the layer's output against the float reference
    block_sqnr_db: float  # SQNR of an H3 block's residual update


class Codec:
    """Base codec: a plain float layer unless a subclass says otherwise."""

    name: str = ""  # the marker's ``format`` value ("float" for the plain codec: no marker)
    quantized: bool = True
    description: str = ""
    targets: tuple[Target, ...] = ()
    verify: VerifyLimits | None = None
    marker_defaults: dict[str, Any] = {}  # what ComfyUI assumes when a field is absent
    runtime_tensors: tuple[str, ...] = ()  # suffixes the runtime loads (bias aside)
    runtime_required: tuple[str, ...] = ()
    deep_scales: tuple[str, ...] = ()  # scale tensors whose values must be finite and > 0
    chunked: bool = True  # encodes independent row chunks (else the whole layer at once)
    unrowed_outputs: tuple[str, ...] = ()  # outputs that are not indexed by row (a codebook)
    always_convrot: bool = False  # the format rotates whatever its marker says
    weight_bits: int = 16  # bits per stored weight code: verify's limits are per class (8 or 4)
    layout: str = "canonical"  # "npu": a pre-transposed layout of the codec named ``canonical``
    canonical: str | None = None  # for a layout variant: the codec it re-lays out
    transposed_outputs: tuple[str, ...] = ()  # encode() gives [n, K] rows, stored as [K, N]
    column_sources: tuple[str, ...] = ()  # stored [K, N]: layer row r is stored column r

    # ------------------------------------------------------------------ header-level knowledge
    def logical_k(self, cols: int, fields: dict | None) -> int:
        """Logical input width K of a stored weight with ``cols`` columns."""
        return cols

    def logical_shape(self, shape: tuple[int, int], fields: dict | None) -> tuple[int, int]:
        """Logical ``(N, K)`` of a stored 2-D weight of ``shape``."""
        return shape[0], self.logical_k(shape[1], fields)

    def uses_convrot(self, fields: dict | None) -> bool:
        return self.always_convrot or bool(fields and fields.get("convrot"))

    def describe(self, fields: dict | None) -> str:
        """Short text for a layer's storage (``int8_tensorwise convrot g=256`` ...)."""
        return self.name

    def marker(self, target: Target, group_size: int) -> dict | None:
        """The canonical marker object ``target`` writes (None: a plain layer, no marker)."""
        return None

    def fit_error(self, layer, fields: dict) -> str | None:
        """Why ``layer``'s header entries do not match marker ``fields`` (None when they do)."""
        return None

    def same_target(self, layer, fields: dict, marker: dict | None) -> bool:
        """The layer already stores exactly what ``marker`` would be written as (re-emit it)."""
        return False

    def skip_reason(self, k: int, marker: dict | None) -> str | None:
        """Why a layer of input width ``k`` cannot be written with ``marker`` (None: it can)."""
        return None

    def planned(self, n: int, k: int, marker: dict | None) -> dict[str, tuple[str, tuple]]:
        """Output tensors ``{suffix: (dtype, shape)}`` of one layer (marker tensor aside)."""
        return {"weight": ("BF16", (n, k))}

    def keep_declared(self, suffix: str, dtype: str, shape: tuple, n: int) -> tuple[str, tuple]:
        """How a kept (re-emitted) tensor is declared: same bytes, canonical dtype and shape."""
        return dtype, shape

    # ------------------------------------------------------------------ tensor work
    def source_tensors(self, fields: dict | None, tensors: dict) -> tuple[list[str], list[str]]:
        """(suffixes read row by row, suffixes read whole) to decode rows of a stored weight."""
        return ["weight"], []

    def decode_rows(self, rows: dict, whole: dict, fields: dict | None) -> torch.Tensor:
        """Rows of the weight in the original basis (fp32 for quantized formats)."""
        return rows["weight"]

    calibrates: bool = False  # encode() takes statistics (``calibration``) to choose its codes

    def encode(self, w: torch.Tensor, marker: dict | None, method: str,
               pool=None, calibration=None) -> dict[str, torch.Tensor]:
        """Encode float rows ``w`` [n, K] into this format's tensors (marker tensor aside).

        ``pool``: an executor a whole-layer codec (``chunked = False``) may spread its row
        chunks over; row-chunked codecs are called per chunk and ignore it. ``calibration``:
        the layer's input statistics (``h3quant.calibration.LayerStats``) for a codec with
        ``calibrates``: the same scales, codes chosen by error feedback; None: round to
        nearest (the uncalibrated bytes, exactly)."""
        import torch

        return {"weight": w.to(torch.bfloat16)}

    def report_grid(self, out: dict, marker: dict | None):
        """(dequantized weight fp32, int8 grid ``(q, s, convrot, g)`` or None) of encoded ``out``."""
        return out["weight"].float(), None

    def int8_grid(self, tensors: dict, fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [N, K], fp32 per-row scales [N]) the int8 runtime multiplies."""
        raise NotImplementedError(f"{self.name} layers have no int8 grid")

    def runtime_weights(self, tensors: dict, grid: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes, fp32 scale) a runtime linear is built from, given the layer's int8 grid."""
        return grid

    def row_range(self, tensors: dict, th) -> RowRange:
        """verify's reference-free check of the int8 grid: the legal per-row code peak."""
        return RowRange(per_tensor=False, low=127, high=127, no_min128=True, text="max|q| = 127 per row")
