"""Plain float layers: the weight is its own decoding; encoding rounds to BF16."""

from __future__ import annotations

from h3quant.formats.codec import Codec
from h3quant.formats.plain.spec import SPEC

CODEC = Codec(SPEC)  # the default facets' tensor work is the plain layer's
