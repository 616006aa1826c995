"""The blobs port: what domain code and the tensor codec see of object storage.

`RangeFetcher` is the one download primitive (fill caller-owned buffers from a byte range of an
object). The credentialed `BlobStore` implements it through the S3 API; processes without S3
credentials (trainers, sites) use `fedhive.blobs.http.PresignedFetcher`, which reads the
presigned URL carried by the ref, and upload with `fedhive.blobs.upload.PresignedUploader`
through presigned PUT URLs or a `MultipartGrant` that a credentialed process made for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import BinaryIO, Protocol, runtime_checkable

Bytes = bytes | bytearray | memoryview
# What a PUT to a write-once presigned URL (`BlobStore.presign_put(write_once=True)`) carries
WRITE_ONCE_HEADERS: Mapping[str, str] = MappingProxyType({"If-None-Match": "*"})


@dataclass(frozen=True)
class PresignedUrl:
    url: str
    expires_at_ms: int  # unix epoch milliseconds


@dataclass(frozen=True)
class MultipartGrant:
    """A multipart upload opened by a credentialed process for someone without credentials:
    part i+1 is bytes [i * part_size, (i + 1) * part_size) of the object, PUT to `urls[i]`."""

    upload_id: str
    part_size: int
    urls: list[PresignedUrl]


@dataclass(frozen=True)
class BlobLocation:
    """An object as a reader knows it: its key (always, for errors) and, maybe, a presigned GET
    with its expiry (unix epoch ms; 0 = unknown)."""

    key: str
    url: str = ""
    expires_at_ms: int = 0


class RangeFetcher(Protocol):
    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        """Fill `dests` in order with the object's bytes from `offset` on, or raise.

        Raises BlobNotFound, BlobAccessDenied, InvalidArgument (range outside the object) or,
        once retries are spent, Unavailable. Never leaves a failure looking like data.
        """
        ...


@runtime_checkable
class UrlPreparer(Protocol):
    """A fetcher that wants to see every location before a batch of reads (to renew, in one
    call, the presigned URLs that are about to expire): `unpack` calls `prepare` first."""

    def prepare(self, wheres: Sequence[BlobLocation]) -> None: ...


class BlobStore(RangeFetcher, Protocol):
    """Credentialed object storage: one bucket, keys chosen by the caller (see `Names`)."""

    @property
    def bucket(self) -> str: ...

    def ensure_bucket(self) -> None:
        """Create the bucket if it is missing; safe to call any number of times."""
        ...

    def put(self, key: str, body: Bytes | Sequence[Bytes]) -> None:
        """Store the concatenation of `body` (one buffer or several); large bodies go multipart,
        streamed from the buffers without a joined copy."""
        ...

    def put_file(self, key: str, file: BinaryIO) -> None:
        """Store what an open binary file holds, read part by part (never whole)."""
        ...

    def get(self, key: str) -> bytes: ...

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> None:
        """Parallel ranged download of `len(dest)` bytes from `offset` straight into `dest`."""
        ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def delete(self, *keys: str) -> None:
        """Delete the keys (many in one request where the store can); deleting a missing key
        is not an error."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; returns how many were deleted."""
        ...

    def presign_get(self, key: str, expires_in: int) -> PresignedUrl: ...

    def presign_put(
        self, key: str, expires_in: int, *, write_once: bool = False
    ) -> PresignedUrl:
        """A presigned PUT of `key`. With `write_once` the URL works only for a PUT carrying
        `If-None-Match: *` (`WRITE_ONCE_HEADERS`, a signed header) and only while `key` holds
        no object: S3 answers 412 after that, so the URL cannot rewrite what it wrote."""
        ...

    def presign_multipart(
        self, key: str, size: int, part_size: int, expires_in: int
    ) -> MultipartGrant:
        """Open a multipart upload of a `size`-byte object and presign a PUT for each part.

        `part_size` is raised to S3's 5 MiB minimum, and further when `size` would need more
        than 10,000 parts; the grant says the size used. Presigned URLs use the public endpoint
        when one is configured."""
        ...

    def complete_multipart(
        self, key: str, upload_id: str, etags: Sequence[str], *, write_once: bool = False
    ) -> None:
        """Assemble the object from its parts (`etags[i]` is part i+1's ETag, as the part
        PUT answered it). Raises InvalidArgument for a wrong part list or an unknown upload;
        with `write_once`, AlreadyExists when `key` holds an object already (nothing is
        written: S3's conditional write, `If-None-Match: *`, which a store without it
        ignores)."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload and its parts; an unknown upload is no error."""
        ...
