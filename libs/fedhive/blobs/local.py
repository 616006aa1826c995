"""A `BlobStore` on local disk with real presigned URLs, for runs without S3 (`fedhive simulate`).

Objects are files under a folder (`fedhive.blobs.local_folder`: atomic writes, keys kept
inside it); presigned URLs are served by an HTTP server the store owns
(`fedhive.blobs.local_http`: 127.0.0.1, an ephemeral port, answering as S3 does). So trainers
and client jobs read and write tensors through the same `PresignedFetcher` and
`PresignedUploader` code as against S3: range reads, write-once PUTs, multipart grants, expired
URLs re-signed through the issuer. A URL is signed with a key of this store only: it dies with
the store (`close()`), as an S3 URL dies with the credentials that signed it.

S3's limits are kept where callers see them (expiry 1 s to 7 days, parts of 5 MiB or more, at
most 10,000 parts), so a grant made here looks like one made by `S3BlobStore`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from fedhive.blobs.local_folder import CHUNK, MIN_PART, Folder
from fedhive.blobs.local_http import UrlServer
from fedhive.blobs.port import (
    WRITE_ONCE_HEADERS,
    BlobLocation,
    Bytes,
    MultipartGrant,
    PresignedUrl,
)
from fedhive.blobs.transfer import Segment, body_views, fill, plan_reads, run_reads
from fedhive.errors import InvalidArgument

_MAX_PARTS = 10_000
_MAX_EXPIRY = 7 * 24 * 3600


class LocalBlobStore:
    """`BlobStore` over the folder `root_dir` (one bucket); thread-safe. `close()` stops its
    URL server; the files stay (`LocalBlobStore` on the same folder reads them again)."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        bucket: str = "fedhive",
        workers: int = 4,
        read_part_size: int = 8 * CHUNK,
    ) -> None:
        if not bucket or "/" in bucket:
            raise InvalidArgument(f"bucket name {bucket!r} must be one path segment",
                                  field="bucket")
        self._bucket = bucket
        self._folder = Folder(Path(root_dir))
        self._workers = workers
        self._read_part_size = read_part_size
        self._server = UrlServer(self._folder, bucket)

    @property
    def bucket(self) -> str:
        return self._bucket

    def close(self) -> None:
        self._server.close()

    def url_prefix(self) -> str:
        """What every presigned URL of this store starts with (a site's `storage_url`)."""
        return self._server.url_prefix

    # --- objects -------------------------------------------------------------------------------
    def ensure_bucket(self) -> None:
        self._folder.create()

    def put(self, key: str, body: Bytes | Sequence[Bytes]) -> None:
        self._folder.write(key, body_views(body))  # written from the caller's buffers

    def put_file(self, key: str, file: BinaryIO) -> None:
        file.seek(0)  # the whole file, as S3BlobStore stores it
        self._folder.write(key, _chunks(file))

    def get(self, key: str) -> bytes:
        with self._folder.open(key) as file:
            return file.read()

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> None:
        reads = plan_reads([Segment(BlobLocation(key), offset, dest)], self._read_part_size)
        run_reads(self, reads, self._workers)

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        total = sum(len(d) for d in dests)
        if total == 0:
            return
        with self._folder.open(where.key) as file:
            if offset + total > os.fstat(file.fileno()).st_size:
                raise InvalidArgument(f"reading blob {where.key}: bytes {offset}-"
                                      f"{offset + total - 1} lie outside the object",
                                      field=where.key)
            file.seek(offset)
            fill(file.readinto, dests, where.key)

    def exists(self, key: str) -> bool:
        return self._folder.exists(key)

    def size(self, key: str) -> int:
        return self._folder.size(key)

    def delete(self, *keys: str) -> None:
        for key in keys:
            self._folder.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise InvalidArgument("refusing to delete a whole bucket: empty prefix", field="prefix")
        return self._folder.delete_prefix(prefix)

    # --- presigned URLs ------------------------------------------------------------------------
    def presign_get(self, key: str, expires_in: int) -> PresignedUrl:
        return self._presign("GET", key, expires_in)

    def presign_put(
        self, key: str, expires_in: int, *, write_once: bool = False
    ) -> PresignedUrl:
        headers = {name.lower(): value for name, value in WRITE_ONCE_HEADERS.items()}
        return self._presign("PUT", key, expires_in, headers=headers if write_once else None)

    def presign_multipart(
        self, key: str, size: int, part_size: int, expires_in: int
    ) -> MultipartGrant:
        if size <= 0:
            raise InvalidArgument(
                f"multipart upload of blob {key} needs a positive size, not {size}", field="size"
            )
        _check_expiry(expires_in)
        part_size = max(part_size, MIN_PART, -(-size // _MAX_PARTS))
        upload_id = self._folder.create_upload(key)
        urls = [
            self._presign("PUT", key, expires_in,
                          params={"partNumber": str(number), "uploadId": upload_id})
            for number in range(1, -(-size // part_size) + 1)
        ]
        return MultipartGrant(upload_id, part_size, urls)

    def complete_multipart(
        self, key: str, upload_id: str, etags: Sequence[str], *, write_once: bool = False
    ) -> None:
        if not etags or not all(etags):
            raise InvalidArgument(
                f"completing blob {key}: {len(etags)} part ETags, some empty or none",
                field="etags",
            )
        self._folder.complete_upload(key, upload_id, etags, write_once=write_once)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._folder.abort_upload(key, upload_id)

    def _presign(self, method: str, key: str, expires_in: int, *,
                 headers: dict[str, str] | None = None,
                 params: dict[str, str] | None = None) -> PresignedUrl:
        _check_expiry(expires_in)
        self._folder.path(key)  # a key the folder cannot hold gets no URL
        return self._server.presign(method, key, expires_in, headers=headers, params=params)


def _check_expiry(expires_in: int) -> None:
    if not 1 <= expires_in <= _MAX_EXPIRY:
        raise InvalidArgument(
            f"presigned URL expiry {expires_in}s is outside 1..{_MAX_EXPIRY}s",
            field="expires_in",
        )


def _chunks(file: BinaryIO) -> Iterator[bytes]:
    while chunk := file.read(CHUNK):
        yield chunk
