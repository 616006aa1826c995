"""One log line as it is shared: clipped, and told apart when it is an error.

An error line is a structlog JSON line (what every fedhive process writes) of level `error` or
`critical`, or the last line of a Python traceback (`Traceback (most recent call last):`, then
indented frame lines, then the unindented `SomeError: message`). A traceback spans lines, and
batches: `TracebackState` carries whether the lines read so far end inside one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_LINE_BYTES = 4096  # a longer line is cut here and says how much was left out
MAX_ERROR_CHARS = 500  # a site's remembered last error, one line
TRACEBACK_START = "Traceback (most recent call last):"
_LEVEL = re.compile(r'"level"\s*:\s*"(error|critical|fatal|exception)"', re.IGNORECASE)


@dataclass(frozen=True)
class Line:
    """One shared line: `end` is the byte offset just past it in its log file (what a re-sent
    line is recognised by), `text` the line without its newline (clipped)."""

    end: int
    text: str
    error: bool = False


def clip_line(raw: bytes, limit: int = MAX_LINE_BYTES) -> str:
    """`raw` (one line, without its newline) as text: invalid UTF-8 replaced, a trailing `\\r`
    dropped, cut to `limit` bytes with a note of how many were left out."""
    raw = raw.removesuffix(b"\r")
    if len(raw) <= limit:
        return raw.decode("utf-8", errors="replace")
    kept = raw[:limit].decode("utf-8", errors="ignore")
    return f"{kept} [... {len(raw) - limit} bytes clipped]"


def is_json_error(text: str) -> bool:
    """A structlog JSON line of level error or critical (a clipped one too)."""
    return text.startswith("{") and _LEVEL.search(text) is not None


class TracebackState:
    """Whether the lines seen so far end inside a Python traceback; `classify` each line in
    order. `inside` is what a saved tail position keeps."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside

    def classify(self, text: str) -> bool:
        """Whether `text`, the next line, is an error line (see the module)."""
        if text.startswith(TRACEBACK_START):
            self.inside = True
            return False
        if self.inside:
            if not text.strip() or text[0].isspace():
                return False  # a frame, its source line, a caret line
            self.inside = False
            return True  # the exception line: the traceback's last
        return is_json_error(text)


def error_summary(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """An error line as a job's last error is shown: a structlog JSON line as `event: error`
    (the `error` or `reason` field, else the exception's last line), anything else as it is; on
    one line, at most `limit` characters."""
    shown = text
    try:
        values = json.loads(text) if text.startswith("{") else None
    except ValueError:
        values = None
    if isinstance(values, dict):
        event = str(values.get("event") or "")
        detail = values.get("error") or values.get("reason") or ""
        if not detail and isinstance(values.get("exception"), str):
            detail = values["exception"].strip().splitlines()[-1:]
            detail = detail[0] if detail else ""
        shown = f"{event}: {detail}" if event and detail else str(event or detail or text)
    line = " ".join(shown.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
