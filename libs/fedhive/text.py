"""Showing user input in messages without echoing it whole.

Every error that quotes what a user sent (a name, a key, a value from meta.json or a request)
quotes it through `clip`, so a 20 MiB field gives a one-line message of bounded size.
"""

from __future__ import annotations

import json

ECHO_LIMIT = 100  # characters of a quoted value shown in a message


def clip(value: object, limit: int = ECHO_LIMIT, *, quote: bool = True) -> str:
    """`value` as a message shows it: a string as its repr (as it is, without `quote`), anything
    else as JSON (or its repr), cut to `limit` characters with "..." and the full length when
    longer."""
    if isinstance(value, str):
        shown = value[:limit]
        shown = repr(shown) if quote else shown
        return shown if len(value) <= limit else f"{shown}... ({len(value)} characters)"
    text = _text(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _text(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return repr(value)
    except (ValueError, RecursionError):  # e.g. an int past Python's digit limit
        return f"<{type(value).__name__}>"
