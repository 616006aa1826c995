"""Reading a growing log file in batches, from a position that survives restarts.

`read_batch(path, at)` returns the complete lines written after `at.offset` (at most
`MAX_BATCH_BYTES` of the file per call) and the `Position` after them; whoever shares them saves
that position once they are safe (published and confirmed, or stored), so a restarted reader
neither sends everything again nor loses the rest. The only repeats are the lines of a batch
that was sent but whose position was not saved yet: each `Line` carries its end offset, and the
store drops a line whose bytes it has already stored (`fedhive.state.joblogs`).

Bounds: a batch holds at most `MAX_BATCH_LINES` lines; a line is clipped to `MAX_LINE_BYTES`
(the rest of it is skipped, however long, even across calls: `Position.skipping`); an
unfinished last line waits for its newline, unless `final` (the writer has ended) or it is
already longer than a line may be. A file more than
`MAX_BACKLOG_BYTES` ahead of the position (something prints faster than it is shared) is
skipped ahead to its last `MAX_BATCH_BYTES`, with one line saying how much was left out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhive.joblogs.lines import MAX_LINE_BYTES, Line, TracebackState, clip_line

MAX_BATCH_BYTES = 256 * 1024
MAX_BATCH_LINES = 4096  # lines of one batch (what one store call writes)
MAX_BACKLOG_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Position:
    offset: int = 0  # bytes of the file already shared
    skipping: bool = False  # inside an over-long line whose start was shared clipped
    in_traceback: bool = False  # the lines shared so far end inside a Python traceback

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "skipping": self.skipping,
                "in_traceback": self.in_traceback}

    @classmethod
    def from_json(cls, values: Any) -> Position:
        if not isinstance(values, dict):
            return cls()
        offset = values.get("offset")
        return cls(offset if isinstance(offset, int) and offset >= 0 else 0,
                   values.get("skipping") is True, values.get("in_traceback") is True)


@dataclass(frozen=True)
class Batch:
    start: int  # where the first line starts (the offset it was read from)
    lines: tuple[Line, ...]
    after: Position  # where the next read starts
    drained: bool  # it read to the end of the file (an unfinished last line may wait)

    @property
    def size(self) -> int:
        return sum(len(line.text) for line in self.lines)


def read_batch(path: Path, at: Position, *, final: bool = False,
               max_bytes: int = MAX_BATCH_BYTES, max_backlog: int = MAX_BACKLOG_BYTES,
               max_line: int = MAX_LINE_BYTES, max_lines: int = MAX_BATCH_LINES) -> Batch:
    """The next lines of `path` after `at` (see the module); no lines and `drained` when there
    are none (or no file). `final`: the writer has ended, an unfinished last line is shared."""
    try:
        log = path.open("rb")
    except FileNotFoundError:
        return Batch(at.offset, (), at, True)
    with log:
        size = os.fstat(log.fileno()).st_size
        if size <= at.offset:  # nothing new (or the file shrank: nothing fedhive wrote does)
            return Batch(at.offset, (), at, True)
        lines: list[Line] = []
        offset, skipping, traceback = at.offset, at.skipping, TracebackState(at.in_traceback)
        if size - offset > max_backlog:
            ahead = size - max_bytes
            lines.append(Line(ahead, f"[fedhive: {ahead - offset} bytes of this log were "
                                     "skipped: it grew faster than it is shared]"))
            log.seek(ahead - 1)
            offset, skipping, traceback = ahead, log.read(1) != b"\n", TracebackState()
        log.seek(offset)
        data = log.read(max_bytes)
    at_end = offset + len(data) >= size
    start = 0
    if skipping:
        newline = data.find(b"\n")
        if newline < 0:  # all of it is the rest of an over-long line
            after = Position(offset + len(data), not (at_end and final), False)
            return Batch(at.offset, tuple(lines), after, at_end)
        start, skipping = newline + 1, False
    while len(lines) < max_lines and (newline := data.find(b"\n", start)) >= 0:
        text = clip_line(data[start:newline], max_line)
        lines.append(Line(offset + newline + 1, text, traceback.classify(text)))
        start = newline + 1
    if len(lines) >= max_lines:  # full: the rest is the next batch's
        return Batch(at.offset, tuple(lines), Position(offset + start, False, traceback.inside),
                     False)
    rest = data[start:]
    if rest and ((at_end and final) or len(rest) >= max_line):
        text = clip_line(rest, max_line)
        lines.append(Line(offset + len(data), text, traceback.classify(text)))
        start, skipping = len(data), not (at_end and final)
    return Batch(at.offset, tuple(lines), Position(offset + start, skipping, traceback.inside),
                 at_end)
