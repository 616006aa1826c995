"""`TensorCache`: what a long-lived trainer keeps between rounds, so it downloads only tensors
whose content changed (frozen layers are fetched once per job).

    cache = TensorCache()
    while running:
        params = unpack(refs, fetcher, cache=cache)  # only changed tensors are downloaded
        ...

The cache maps a checksum to the buffer behind the array `unpack` returned for it. Training
usually updates arrays in place, so before reusing a buffer `unpack` hashes it again and
downloads the tensor afresh when it no longer matches. A reused tensor is returned over the
same memory as the array returned for it last time (no copy): the cache costs no memory beyond
the arrays the trainer holds anyway. It holds the tensors of the last `unpack` that used it
(older entries are dropped), and is meant for one thread at a time.

Counters, cumulative over the unpacks that used the cache: `bytes_fetched` (downloaded),
`bytes_reused` (served from memory after re-hashing), `bytes_stale` (cached, but changed
since: downloaded again, and counted in `bytes_fetched` too).
"""

from __future__ import annotations

from collections.abc import Mapping

from fedhive.blobs.dtypes import ByteArray


class TensorCache:
    def __init__(self) -> None:
        self._buffers: dict[str, ByteArray] = {}
        self.bytes_fetched = 0
        self.bytes_reused = 0
        self.bytes_stale = 0

    def __len__(self) -> int:
        return len(self._buffers)

    def __contains__(self, checksum: object) -> bool:
        return checksum in self._buffers

    def lookup(self, checksum: str, length: int) -> ByteArray | None:
        """The buffer last returned for `checksum`, if it has `length` bytes (not re-hashed)."""
        buffer = self._buffers.get(checksum)
        return buffer if buffer is not None and buffer.nbytes == length else None

    def retain(self, checksums: set[str]) -> None:
        """Drop the buffers of every other checksum (before an unpack allocates the new
        model, so the cache never holds last round's changed tensors beside it)."""
        self._buffers = {c: b for c, b in self._buffers.items() if c in checksums}

    def replace(self, buffers: Mapping[str, ByteArray]) -> None:
        """Keep exactly `buffers` (checksum -> buffer): what the last unpack returned."""
        self._buffers = dict(buffers)

    def clear(self) -> None:
        self._buffers.clear()
