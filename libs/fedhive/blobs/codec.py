"""The tensor codec: the only way tensors cross a process boundary in fedhive (DESIGN §5).

    codec = TensorCodec(store, settings)
    refs = codec.pack({"w": array, "b": tensor}, Names(ns).tensor_prefix(job_id))
    tensors = codec.unpack(refs)                 # credentialed reader
    tensors = unpack(refs, PresignedFetcher())   # a trainer: presigned URLs only

`pack` sends each array down one of three paths, decided by its size in bytes:
* inline: nbytes <= `inline_threshold` (default `settings.inline_threshold`, 2 MiB; 0 disables)
  -> the bytes travel inside the ref. A pack inlines at most `inline_budget` bytes in total
  (default 8x the threshold) so a model of many small arrays cannot swell one broker message
  past the broker's limit; the rest take the shard path. Empty arrays are always inline.
* shard: below `own_object_threshold` (16 MiB) -> packed back to back into shard objects of up
  to `shard_size` (64 MiB); each ref addresses its bytes by offset/length.
* own object: the rest -> one object each, uploaded multipart with parallel parts.
Objects live under `{prefix}{pack id}/`: a random pack id, so a second pack never overwrites
objects that earlier refs point at. Every ref carries a sha256 of the array's bytes (see
`checksum`) and a presigned GET URL valid for `url_ttl` seconds.

`unpack` allocates one buffer per tensor, has parallel ranged GETs write straight into it
(neighbouring shard members share one request), hashes each part as soon as it lands while
later parts still download, and returns numpy arrays / torch tensors over those buffers.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import structlog

from fedhive.blobs import checksum
from fedhive.blobs.dtypes import (
    ByteArray,
    bytes_to_numpy,
    bytes_to_torch,
    is_torch_tensor,
    numpy_to_bytes,
    torch_to_bytes,
)
from fedhive.blobs.http import PresignedFetcher
from fedhive.blobs.port import BlobLocation, BlobStore, RangeFetcher
from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.blobs.transfer import MiB, RangeRead, Segment, as_byte_view, plan_reads, run_reads
from fedhive.config import Settings
from fedhive.errors import ChecksumMismatch, FedhiveError, InvalidArgument

log = structlog.get_logger()


@dataclass
class _Planned:
    name: str
    flat: ByteArray  # the array's bytes: a view of it, or of its contiguous copy
    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind
    key: str = ""  # "" = inline
    offset: int = 0


class TensorCodec:
    def __init__(
        self,
        store: BlobStore,
        settings: Settings,
        *,
        inline_threshold: int | None = None,
        inline_budget: int | None = None,
        own_object_threshold: int = 16 * MiB,
        shard_size: int = 64 * MiB,
        url_ttl: int = 3600,
        workers: int = 8,
        part_size: int = 8 * MiB,
    ) -> None:
        self._store = store
        self._inline_threshold = (
            settings.inline_threshold if inline_threshold is None else inline_threshold
        )
        self._inline_budget = 8 * self._inline_threshold if inline_budget is None else inline_budget
        self._own_threshold = own_object_threshold
        self._shard_size = max(shard_size, own_object_threshold)
        self._url_ttl = url_ttl
        self._workers = workers
        self._part_size = part_size
        self._urls = PresignedFetcher()

    def close(self) -> None:
        self._urls.close()

    def pack(self, tensors: Mapping[str, Any], prefix: str) -> list[TensorRef]:
        """Upload what does not travel inline; return one ref per tensor, in input order."""
        if not prefix:
            raise InvalidArgument("tensor prefix is empty", field="prefix")
        planned, objects = self._plan(tensors, f"{prefix}{secrets.token_hex(6)}/")
        uploaded: list[str] = []

        def upload_all() -> None:
            for key, views in objects.items():
                self._store.put(key, views)
                uploaded.append(key)

        try:
            with ThreadPoolExecutor(max_workers=1) as uploader:
                upload = uploader.submit(upload_all)
                digests = [checksum.digest(item.flat) for item in planned]  # overlaps upload
                upload.result()
            urls = {key: self._store.presign_get(key, self._url_ttl) for key in objects}
        except BaseException:
            self._discard(uploaded)
            raise
        refs = []
        for item, digest in zip(planned, digests, strict=True):
            url = urls.get(item.key)
            refs.append(
                TensorRef(
                    name=item.name, dtype=item.dtype, shape=item.shape, kind=item.kind,
                    key=item.key, url=url.url if url else "",
                    url_expires_at_ms=url.expires_at_ms if url else 0,
                    offset=item.offset, length=item.flat.nbytes, checksum=digest,
                    inline_data=b"" if item.key else item.flat.tobytes(),
                )
            )
        log.debug("tensors packed", prefix=prefix, tensors=len(refs), objects=len(objects))
        return refs

    def unpack(
        self,
        refs: Sequence[TensorRef],
        *,
        via: Literal["store", "url"] = "store",
        kind: TensorKind | None = None,
    ) -> dict[str, Any]:
        """Materialise refs, reading with the store's credentials or the refs' presigned URLs."""
        fetcher: RangeFetcher = self._store if via == "store" else self._urls
        return unpack(refs, fetcher, kind=kind, workers=self._workers, part_size=self._part_size)

    def _plan(
        self, tensors: Mapping[str, Any], base: str
    ) -> tuple[list[_Planned], dict[str, list[memoryview]]]:
        planned: list[_Planned] = []
        objects: dict[str, list[memoryview]] = {}
        inline_used = shard_fill = 0
        shard_key = ""
        for name, value in tensors.items():
            item = _flatten(name, value)
            size = item.flat.nbytes
            if size == 0 or (
                size <= self._inline_threshold and inline_used + size <= self._inline_budget
            ):
                inline_used += size
            elif size >= self._own_threshold:
                item.key = f"{base}{len(objects):05d}.tensor"
                objects[item.key] = [as_byte_view(item.flat)]
            else:
                if not shard_key or shard_fill + size > self._shard_size:
                    shard_key, shard_fill = f"{base}{len(objects):05d}.shard", 0
                    objects[shard_key] = []
                item.key, item.offset = shard_key, shard_fill
                objects[shard_key].append(as_byte_view(item.flat))
                shard_fill += size
            planned.append(item)
        return planned, objects

    def _discard(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._store.delete(key)
            except FedhiveError as err:
                log.warning("could not delete blob of a failed pack", key=key, error=str(err))


def unpack(
    refs: Sequence[TensorRef],
    fetcher: RangeFetcher,
    *,
    kind: TensorKind | None = None,
    workers: int = 8,
    part_size: int = 8 * MiB,
) -> dict[str, Any]:
    """name -> numpy array / torch tensor (per ref `kind`, or `kind` for all), checksums verified.

    Raises ChecksumMismatch naming the tensor and key when bytes differ from the ref (including
    an object that became shorter), BlobNotFound / BlobAccessDenied from the fetcher.
    """
    names = [ref.name for ref in refs]
    if len(set(names)) != len(names):
        raise InvalidArgument("tensor refs repeat a name", field="name")
    buffers = [np.empty(ref.length, dtype=np.uint8) for ref in refs]
    hashers = [checksum.hasher_for(ref.checksum, ref.name) for ref in refs]
    segments = []
    for tag, (ref, buffer) in enumerate(zip(refs, buffers, strict=True)):
        if ref.is_inline:
            buffer[:] = np.frombuffer(ref.inline_data, dtype=np.uint8)
            hashers[tag].update(buffer)
        else:
            where = BlobLocation(ref.key, ref.url)
            segments.append(Segment(where, ref.offset, as_byte_view(buffer), tag))

    def hash_landed(read: RangeRead) -> None:
        for piece, tag in read.pieces:
            hashers[tag].update(piece)

    try:
        run_reads(fetcher, plan_reads(segments, part_size), workers, hash_landed)
    except InvalidArgument as err:
        victim = next((ref for ref in refs if ref.key and ref.key == err.field), None)
        if victim is None:
            raise
        raise ChecksumMismatch(
            f"tensor {victim.name!r}: blob {victim.key} no longer holds the ref's byte range",
            field=victim.name,
        ) from err
    for ref, hasher in zip(refs, hashers, strict=True):
        if not checksum.matches(ref.checksum, hasher):
            raise ChecksumMismatch(
                f"tensor {ref.name!r}: bytes from {'blob ' + ref.key if ref.key else 'inline data'}"
                f" do not match checksum {ref.checksum[:24]}...",
                field=ref.name,
            )
    return {
        ref.name: _materialise(buffer, ref, kind or ref.kind)
        for ref, buffer in zip(refs, buffers, strict=True)
    }


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


def _materialise(buffer: ByteArray, ref: TensorRef, kind: TensorKind) -> Any:
    if kind is TensorKind.TORCH:
        return bytes_to_torch(buffer, ref.dtype, ref.shape)
    return bytes_to_numpy(buffer, ref.dtype, ref.shape)
