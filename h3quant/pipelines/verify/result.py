"""What every verifier returns: one verdict (``passed`` from the list of ``failures``), one JSON
form, and the SQNR limits a block or a whole model is held to (from the codecs' own limits)."""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.formats import registry
from h3quant.pipelines.metrics import json_safe

_INT8 = registry.class_limits(8)  # every 8-bit format's limits
_W4A8 = registry.class_limits(4)  # every 4-bit format's


@dataclass(frozen=True)
class SqnrLimits:
    """SQNR a block's residual update or the model's outputs must reach: the int8 limit when every
    quantized linear is 8-bit, the W4A8 one when any is 4-bit (docs/FORMATS.md, verify)."""

    sqnr_db_int8: float = _INT8.block_sqnr_db
    sqnr_db_w4a8: float = _W4A8.block_sqnr_db

    def limit(self, formats) -> float:
        """The loosest limit of the formats present (a format run through its decode brings
        its own block limit)."""
        formats = list(formats)
        grid = [f for f in formats if registry.decoded_limits(f) is None]
        own = [lim.block_sqnr_db for f in formats if (lim := registry.decoded_limits(f))]
        base = self.sqnr_db_w4a8 if registry.low_bit(grid) else self.sqnr_db_int8
        return min([base, *own]) if own else base


class Verdict:
    """Mixin of the result dataclasses: subclasses list their ``failures``; ``passed`` and the
    JSON envelope (``passed``, ``failures``, non-finite numbers as strings) are shared."""

    @property
    def failures(self) -> list[str]:
        raise NotImplementedError

    @property
    def passed(self) -> bool:
        return not self.failures

    def verdict_dict(self, body: dict) -> dict:
        return json_safe({**body, "passed": self.passed, "failures": self.failures})


def by_encode(label: str | None) -> str:
    """The tail of a failure line naming the fresh encode its limit came from (nothing for a
    fixed limit)."""
    return "" if label is None else f" (from the {label} fresh encode, less the margin)"
