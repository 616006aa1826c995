"""`PresignedUploader`: writing objects with no credentials, through presigned URLs.

    uploader = PresignedUploader()
    uploader.put(url, key, array)                      # one PUT (small objects)
    uploader.put(url, key, array, headers=WRITE_ONCE_HEADERS)  # to a write-once URL
    etags = uploader.put_parts(grant, key, array)      # a MultipartGrant: parts in parallel
    # ... the grant's issuer completes the upload with `etags` (BlobStore.complete_multipart)

Bodies are streamed from the caller's buffers (numpy arrays, bytes, lists of them) without a
joined copy. Each part is retried on its own (`fedhive.retry.Backoff`, transient failures
only), so one bad connection costs one part, not the object. Timeouts measure lack of
progress (see `fedhive.blobs.http`): a slow part that keeps moving is never cut off.

A write-once PUT (`BlobStore.presign_put(write_once=True)`) that S3 refuses because the key
holds an object (412) counts as done: a key given to one writer only is that writer's own
earlier upload, e.g. one whose answer was lost and that the retry sent again. Whether the bytes
are right is for the reader to check (checksums), as for any object.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from fedhive.blobs.http import HttpPool, put_object
from fedhive.blobs.port import Bytes, MultipartGrant
from fedhive.blobs.transfer import GatherReader, body_views, slice_views
from fedhive.errors import AlreadyExists, FedhiveError, InvalidArgument, Unavailable
from fedhive.retry import Backoff

log = structlog.get_logger()


class PresignedUploader:
    """Uploads through presigned URLs; thread-safe. `bytes_sent` counts what S3 accepted."""

    def __init__(
        self,
        *,
        stall_timeout: float = 60.0,
        backoff: Backoff | None = None,
        ssl_context: ssl.SSLContext | None = None,
        workers: int = 8,
        pool: HttpPool | None = None,
    ) -> None:
        self._pool = pool or HttpPool(stall_timeout=stall_timeout, ssl_context=ssl_context)
        self._owns_pool = pool is None
        self._backoff = backoff or Backoff()
        self._workers = max(1, workers)
        self._lock = threading.Lock()
        self._bytes = 0

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self._bytes

    def put(self, url: str, key: str, body: Bytes | Sequence[Bytes], *,
            headers: Mapping[str, str] | None = None) -> None:
        """One PUT of `body` (one buffer or several, concatenated) to a presigned URL, with the
        `headers` it was signed with; `key` names the object in errors. A write-once key that
        is written already (412) is no error: nothing is sent again."""
        views = body_views(body)
        try:
            put_object(self._pool, self._backoff, url, key, views, headers)
        except AlreadyExists:
            log.debug("write-once object written already", key=key)
            return
        self._count(sum(len(v) for v in views))

    def put_parts(
        self, grant: MultipartGrant, key: str, body: Bytes | Sequence[Bytes]
    ) -> list[str]:
        """PUT part i+1 = bytes [i * part_size, (i + 1) * part_size) of `body` to `grant.urls[i]`,
        in parallel; returns the parts' ETags in order, for completing the upload. Raises
        InvalidArgument when the grant does not fit the body's size, the part's error once its
        retries are spent (BlobAccessDenied for an expired or refused URL)."""
        views = body_views(body)
        total = sum(len(v) for v in views)
        size = grant.part_size
        count = -(-total // size) if size > 0 else 0
        if total == 0 or count != len(grant.urls):
            raise InvalidArgument(
                f"writing blob {key}: {total} bytes in parts of {size} bytes make {count} "
                f"parts, the grant has {len(grant.urls)} part URLs",
                field="part_urls",
            )

        def upload(number: int) -> str:
            start = (number - 1) * size
            pieces = slice_views(views, start, min(start + size, total))

            def answered(response: http.client.HTTPResponse) -> str:
                response.read()
                etag = response.getheader("ETag") or ""
                if not etag:
                    raise FedhiveError(
                        f"writing blob {key}: S3 answered part {number} without an ETag",
                        field=key,
                    )
                return etag

            def once() -> str:
                url = grant.urls[number - 1].url
                return self._pool.exchange("PUT", url, key, {}, GatherReader(pieces), answered)

            def on_retry(err: BaseException, wait: float) -> None:
                log.warning("part upload retried", key=key, part=number, error=str(err),
                            wait=wait)

            etag = self._backoff.call(once, retry_on=(Unavailable,), on_retry=on_retry)
            self._count(sum(len(p) for p in pieces))
            return etag

        with ThreadPoolExecutor(max_workers=min(self._workers, count)) as pool:
            futures = [pool.submit(upload, number) for number in range(1, count + 1)]
            try:
                return [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise  # leaving the pool's `with` waits for the parts already running

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
