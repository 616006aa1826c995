"""The tensor codec: the only way tensors cross a process boundary in fedhive (DESIGN §5).

    codec = TensorCodec(store, settings)
    refs = codec.pack({"w": array, "b": tensor}, Names(ns).job_tensor_prefix(job_id))
    tensors = codec.unpack(refs)                 # credentialed reader
    tensors = unpack(refs, PresignedFetcher())   # a trainer: presigned URLs only

`pack` sends each array down one of two paths, decided by its size in bytes:
* inline: nbytes <= `inline_threshold` (default `settings.inline_threshold`, 2 MiB; 0 disables)
  -> the bytes travel inside the ref. A pack inlines at most `inline_budget` bytes in total
  (default 8x the threshold) so a model of many small arrays cannot swell one broker message
  past the broker's limit; the rest are stored. Empty arrays are always inline.
* stored: one object per distinct content, at `content_key(prefix, checksum)` =
  `{prefix}blake3/<hex>`. An object that exists already (HEAD, with the right size) is not
  uploaded again, and a key is never given other bytes: a ref can never see a mix of rounds,
  and a tensor that did not change between rounds (frozen layers) is uploaded once per job and
  recognised by a trainer's `TensorCache`. (Content addressing per tensor is also why there
  are no shard objects packing several tensors together: a shard's key would depend on all of
  its members, so one changed tensor would re-upload all of them.)

Every ref carries the BLAKE3 checksum of the array's bytes (see `checksum`) and a presigned GET URL
valid for `url_ttl` seconds. The key depends on the hash, so hashing runs ahead of uploading:
the calling thread hashes tensor i+1 while tensor i uploads (the hasher releases the GIL).
Objects of at least `large_object` bytes upload one at a time, their parts in parallel (the
store's multipart upload); smaller ones `workers` at a time. A failed pack deletes nothing:
its objects may already be shared with other refs; they go with the job's tensor prefix.

`unpack` (see `fedhive.blobs.unpack`) allocates one buffer per tensor, has parallel ranged
GETs write straight into it, verifies checksums and returns numpy arrays / torch tensors
over those buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import structlog

from fedhive.blobs import checksum
from fedhive.blobs.cache import TensorCache
from fedhive.blobs.dtypes import ByteArray, is_torch_tensor, numpy_to_bytes, torch_to_bytes
from fedhive.blobs.http import PresignedFetcher
from fedhive.blobs.keys import content_key
from fedhive.blobs.port import BlobStore, RangeFetcher
from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.blobs.transfer import MiB, as_byte_view
from fedhive.blobs.unpack import unpack
from fedhive.config import Settings
from fedhive.errors import BlobNotFound, InvalidArgument

log = structlog.get_logger()


@dataclass
class _Planned:
    name: str
    flat: ByteArray  # the array's bytes: a view of it, or of its contiguous copy
    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind
    inline: bool = False


@dataclass(frozen=True)
class PackStats:
    """What a codec's packs did to storage, cumulative (for tests and benchmarks)."""

    objects_uploaded: int = 0
    bytes_uploaded: int = 0
    objects_present: int = 0  # found stored already: not uploaded again
    bytes_present: int = 0


def inline_budget_for(threshold: int, budget: int | None = None) -> int:
    """How many bytes one message may carry inline: `budget`, or by default 8 arrays at the
    threshold (so a model of many small arrays cannot swell one message past the broker's
    limit)."""
    return 8 * threshold if budget is None else budget


class TensorCodec:
    def __init__(
        self,
        store: BlobStore,
        settings: Settings,
        *,
        inline_threshold: int | None = None,
        inline_budget: int | None = None,
        url_ttl: int = 3600,
        workers: int = 8,
        part_size: int = 8 * MiB,
        large_object: int = 16 * MiB,
    ) -> None:
        self._store = store
        self._inline_threshold = (
            settings.inline_threshold if inline_threshold is None else inline_threshold
        )
        self._inline_budget = inline_budget_for(self._inline_threshold, inline_budget)
        self._url_ttl = url_ttl
        self._workers = max(1, workers)
        self._part_size = part_size
        self._large = large_object
        self._urls = PresignedFetcher()
        self._lock = threading.Lock()
        self._stats = PackStats()

    @property
    def stats(self) -> PackStats:
        with self._lock:
            return self._stats

    @property
    def inline_threshold(self) -> int:
        return self._inline_threshold

    @property
    def inline_budget(self) -> int:
        return self._inline_budget

    def close(self) -> None:
        self._urls.close()

    def pack(self, tensors: Mapping[str, Any], prefix: str) -> list[TensorRef]:
        """Store what does not travel inline (at content keys under `prefix`, skipping objects
        that exist); return one ref per tensor, in input order."""
        if not prefix:
            raise InvalidArgument("tensor prefix is empty", field="prefix")
        planned = self._plan(tensors)
        digests: list[str] = []
        uploads: dict[str, Future[None]] = {}
        with ThreadPoolExecutor(self._workers) as small, ThreadPoolExecutor(1) as large:
            try:
                for item in planned:
                    digest = checksum.digest(item.flat)  # overlaps the uploads already running
                    digests.append(digest)
                    if item.inline:
                        continue
                    key = content_key(prefix, digest)
                    if key not in uploads:
                        lane = large if item.flat.nbytes >= self._large else small
                        uploads[key] = lane.submit(self._store_once, key, item.flat)
                for future in uploads.values():
                    future.result()
            except BaseException:
                for future in uploads.values():
                    future.cancel()
                raise  # leaving the pools' `with` waits for the uploads already running
        urls = {key: self._store.presign_get(key, self._url_ttl) for key in uploads}
        refs = []
        for item, digest in zip(planned, digests, strict=True):
            key = "" if item.inline else content_key(prefix, digest)
            url = urls.get(key)
            refs.append(
                TensorRef(
                    name=item.name, dtype=item.dtype, shape=item.shape, kind=item.kind,
                    key=key, url=url.url if url else "",
                    url_expires_at_ms=url.expires_at_ms if url else 0,
                    length=item.flat.nbytes, checksum=digest,
                    inline_data=item.flat.tobytes() if item.inline else b"",
                )
            )
        log.debug("tensors packed", prefix=prefix, tensors=len(refs), objects=len(uploads))
        return refs

    def store(self, refs: Sequence[TensorRef], prefix: str) -> list[TensorRef]:
        """`refs` with each inline one turned into a stored one, its bytes put at its content
        key under `prefix` (once, skipped where the object exists); the others as they are.
        For data many receivers get: a key travels once per receiver, its bytes are read once
        by each from storage, while inline bytes would pass the sender's socket each time.
        The stored refs carry no URL: the sender presigns what it sends. InvalidArgument, and
        nothing stored, where an inline ref's bytes do not match its checksum (a content key
        must never hold other bytes)."""
        if not prefix:
            raise InvalidArgument("tensor prefix is empty", field="prefix")
        inline = {content_key(prefix, ref.checksum): ref for ref in refs
                  if ref.is_inline and ref.length}
        for ref in inline.values():
            if not checksum.matches_data(ref.checksum, ref.inline_data, ref.name):
                raise InvalidArgument(f"tensor {ref.name!r}: inline data does not match its "
                                      f"checksum {ref.checksum[:20]!r}", field=ref.name)
        if inline:
            with ThreadPoolExecutor(min(self._workers, len(inline))) as pool:
                for future in [pool.submit(self._store_once, key,
                                           np.frombuffer(ref.inline_data, np.uint8))
                               for key, ref in inline.items()]:
                    future.result()
        return [replace(ref, key=content_key(prefix, ref.checksum), inline_data=b"")
                if ref.is_inline and ref.length else ref for ref in refs]

    def unpack(
        self,
        refs: Sequence[TensorRef],
        *,
        via: Literal["store", "url"] = "store",
        kind: TensorKind | None = None,
        cache: TensorCache | None = None,
    ) -> dict[str, Any]:
        """Materialise refs, reading with the store's credentials or the refs' presigned URLs."""
        fetcher: RangeFetcher = self._store if via == "store" else self._urls
        return unpack(refs, fetcher, kind=kind, workers=self._workers,
                      part_size=self._part_size, cache=cache)

    def _plan(self, tensors: Mapping[str, Any]) -> list[_Planned]:
        planned: list[_Planned] = []
        inline_used = 0
        for name, value in tensors.items():
            item = _flatten(name, value)
            size = item.flat.nbytes
            if size == 0 or (
                size <= self._inline_threshold and inline_used + size <= self._inline_budget
            ):
                inline_used += size
                item.inline = True
            planned.append(item)
        return planned

    def _store_once(self, key: str, flat: ByteArray) -> None:
        """Upload `flat` to its content key unless the object is there already. An object of
        the wrong size at a content key is corrupt (it can only ever hold these bytes): it is
        replaced, which no reader can mind."""
        try:
            stored = self._store.size(key)
        except BlobNotFound:
            stored = -1
        if stored == flat.nbytes:
            self._count(present=stored)
            return
        if stored >= 0:
            log.warning("content object has the wrong size; rewriting it", key=key,
                        size=stored, expected=flat.nbytes)
        self._store.put(key, [as_byte_view(flat)])
        self._count(uploaded=flat.nbytes)

    def _count(self, *, uploaded: int = -1, present: int = -1) -> None:
        with self._lock:
            s = self._stats
            self._stats = PackStats(
                s.objects_uploaded + (uploaded >= 0), s.bytes_uploaded + max(uploaded, 0),
                s.objects_present + (present >= 0), s.bytes_present + max(present, 0),
            )


def inline_refs(tensors: Mapping[str, Any], *, limit: int) -> list[TensorRef]:
    """Every tensor as an inline ref, for a sender with no storage of its own (an admin's
    operation data); InvalidArgument past `limit` bytes in all."""
    refs, total = [], 0
    for name, value in tensors.items():
        item = _flatten(name, value)
        total += item.flat.nbytes
        if total > limit:
            raise InvalidArgument(f"the tensors are more than {limit} bytes: too large to send "
                                  "inline", field=name)
        refs.append(TensorRef(name=name, dtype=item.dtype, shape=item.shape, kind=item.kind,
                              length=item.flat.nbytes, checksum=checksum.digest(item.flat),
                              inline_data=item.flat.tobytes()))
    return refs


def _flatten(name: str, value: Any) -> _Planned:
    if is_torch_tensor(value):
        flat, dtype = torch_to_bytes(name, value)
        return _Planned(name, flat, dtype, tuple(int(d) for d in value.shape), TensorKind.TORCH)
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        flat, dtype = numpy_to_bytes(name, array)
        return _Planned(name, flat, dtype, tuple(array.shape), TensorKind.NUMPY)
    raise InvalidArgument(
        f"tensor {name!r} is a {type(value).__name__}, not a numpy array or torch tensor",
        field=name,
    )
