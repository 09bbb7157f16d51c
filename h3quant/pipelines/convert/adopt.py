"""Moved to ``h3quant.source_view`` (shared by every reader of a source or reference); the
names stay importable here."""

from h3quant.source_view import *  # noqa: F401,F403
from h3quant.source_view import (  # noqa: F401
    CACHE_EXTRA,
    SourceView,
    adopt_mapping,
    build_target,
    check_scale,
    decode_fp8,
    has_config,
    open_as_comfy,
)
