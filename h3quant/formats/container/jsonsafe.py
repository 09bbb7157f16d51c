"""JSON from untrusted files: every failure is a ``ValueError`` with a short reason.

``json.loads`` raises ``RecursionError`` on deep nesting and a plain ``ValueError`` (not a
``JSONDecodeError``) on integers longer than Python's digit limit; callers that catch only
``JSONDecodeError`` would let those reach the internal-error path.
"""

from __future__ import annotations

import json


def loads(text: str | bytes):
    """Parse JSON; ``ValueError`` with a clear reason for anything that is not sane JSON."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at char {exc.pos}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:  # e.g. an integer with thousands of digits
        raise ValueError(str(exc).split(";")[0]) from None
    if "\\ud" in text or "\\uD" in text:  # escaped surrogates: legal only as pairs
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds an unpaired UTF-16 surrogate escape (not valid "
                             "Unicode)") from None
    return obj

