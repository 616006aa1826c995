"""Zero-copy transfer plumbing shared by the S3 adapter, the presigned-URL reader and the codec.

* `GatherReader` streams the concatenation of caller buffers to an HTTP body (upload) without
  joining them: only the small blocks the HTTP client asks for are copied.
* `plan_reads` turns "these byte ranges of these objects go into these buffers" into ranged
  GETs of at most `part_size` bytes, merging neighbouring ranges of one object into one request.
* `run_reads` runs them on a thread pool; each worker writes straight into its slice of the
  destination buffers, and the caller sees each read complete in plan order (to hash while
  later parts are still downloading).
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fedhive.blobs.port import BlobLocation, Bytes, RangeFetcher
from fedhive.errors import Unavailable

MiB = 1024 * 1024
READ_CHUNK = 1 * MiB  # largest single readinto: bounds any temporary copy a client makes


def as_byte_view(data: Bytes | Any) -> memoryview:
    """A flat unsigned-byte memoryview of any contiguous buffer (bytes, numpy array, ...)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def body_views(body: Bytes | Sequence[Bytes]) -> list[memoryview]:
    """Byte views of an upload body given as one buffer or a list/tuple of buffers."""
    parts = body if isinstance(body, list | tuple) else [body]
    return [as_byte_view(part) for part in parts]


class GatherReader(io.RawIOBase):
    """A seekable, read-only file over the concatenation of several buffers."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = [v for v in views if len(v)]
        self._starts: list[int] = []
        total = 0
        for view in self._views:
            self._starts.append(total)
            total += len(view)
        self._size = total
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = as_byte_view(buffer)
        written = 0
        while written < len(out) and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            start = self._pos - self._starts[i]
            n = min(len(out) - written, len(self._views[i]) - start)
            out[written : written + n] = self._views[i][start : start + n]
            written += n
            self._pos += n
        return written

    def read(self, size: int | None = -1) -> bytes:
        left = self._size - self._pos
        n = left if size is None or size < 0 else min(size, left)
        i = bisect.bisect_right(self._starts, self._pos) - 1 if n else -1
        if n and self._pos - self._starts[i] + n <= len(self._views[i]):
            start = self._pos - self._starts[i]  # common case: one copy, no bytearray
            self._pos += n
            return bytes(self._views[i][start : start + n])
        chunk = bytearray(n)
        self.readinto(chunk)
        return bytes(chunk)


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The pieces of `views`' concatenation that cover bytes [start, stop)."""
    pieces, base = [], 0
    for view in views:
        lo, hi = max(start, base), min(stop, base + len(view))
        if lo < hi:
            pieces.append(view[lo - base : hi - base])
        base += len(view)
    return pieces


@dataclass
class RangeRead:
    """One ranged GET: bytes [offset, offset + sum of piece sizes) of `where`."""

    where: BlobLocation
    offset: int
    pieces: list[tuple[memoryview, int]] = field(default_factory=list)  # (dest slice, tag)
    size: int = 0


@dataclass(frozen=True)
class Segment:
    """`dest` is to be filled from `where` starting at byte `offset`; `tag` is the caller's."""

    where: BlobLocation
    offset: int
    dest: memoryview
    tag: int = 0


def plan_reads(segments: Iterable[Segment], part_size: int) -> list[RangeRead]:
    """Split/merge segments into reads of at most `part_size` bytes, in object-offset order."""
    by_object: dict[BlobLocation, list[Segment]] = {}
    for segment in segments:
        if len(segment.dest):
            by_object.setdefault(segment.where, []).append(segment)
    reads: list[RangeRead] = []
    for where, members in by_object.items():
        current: RangeRead | None = None
        for segment in sorted(members, key=lambda s: s.offset):
            done = 0
            while done < len(segment.dest):
                at = segment.offset + done
                if current is None or current.offset + current.size != at or (
                    current.size >= part_size
                ):
                    current = RangeRead(where, at)
                    reads.append(current)
                take = min(part_size - current.size, len(segment.dest) - done)
                current.pieces.append((segment.dest[done : done + take], segment.tag))
                current.size += take
                done += take
    return reads


def fill(readinto: Callable[[memoryview], int], pieces: Iterable[memoryview], key: str) -> None:
    """Read a response body into `pieces`, in order, until each is full."""
    for piece in pieces:
        done = 0
        while done < len(piece):
            n = readinto(piece[done : done + READ_CHUNK])
            if not n:
                raise Unavailable(f"connection closed early while reading blob {key}", field=key)
            done += n


def run_reads(
    fetcher: RangeFetcher,
    reads: Sequence[RangeRead],
    workers: int,
    on_read_done: Callable[[RangeRead], None] | None = None,
) -> None:
    """Run `reads` in parallel; `on_read_done` is called in plan order as each one lands.

    On the first failure the reads not yet started are cancelled, the running ones are waited
    for (no worker writes into a buffer after this returns), and the failure is raised.
    """
    if not reads:
        return
    if len(reads) == 1 or workers <= 1:  # no thread to start (a server job reads a result)
        for read in reads:
            fetcher.fetch_range(read.where, read.offset, [p for p, _ in read.pieces])
            if on_read_done is not None:
                on_read_done(read)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(reads))) as pool:
        futures: list[Future[None]] = [
            pool.submit(fetcher.fetch_range, r.where, r.offset, [p for p, _ in r.pieces])
            for r in reads
        ]
        try:
            for read, future in zip(reads, futures, strict=True):
                future.result()
                if on_read_done is not None:
                    on_read_done(read)
        except BaseException:
            for future in futures:
                future.cancel()
            raise  # leaving the pool's `with` waits for the reads already running
