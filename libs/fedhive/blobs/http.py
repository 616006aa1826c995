"""Credential-free blob access through presigned URLs, over plain HTTP(S).

Trainers and sites hold no S3 credentials (DESIGN §5, §7): they read (and later write) objects
only through the presigned URLs in refs. http.client is used directly, with a small pool of
keep-alive connections per host, because its `readinto` moves bytes from the socket straight
into the destination buffer: no per-chunk copies.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

from fedhive.blobs.failures import parse_error_document, s3_failure
from fedhive.blobs.port import BlobLocation, Bytes
from fedhive.blobs.transfer import GatherReader, body_views, fill
from fedhive.errors import InvalidArgument, Unavailable
from fedhive.retry import Backoff

_ERROR_BODY_LIMIT = 64 * 1024
_Origin = tuple[str, str, int]


class PresignedFetcher:
    """A `RangeFetcher` (and presigned-PUT uploader) that needs no credentials; thread-safe."""

    def __init__(
        self,
        *,
        timeout: float = 60.0,
        backoff: Backoff | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._timeout = timeout
        self._backoff = backoff or Backoff()
        self._ssl = ssl_context or ssl.create_default_context()
        self._idle: dict[_Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        total = sum(len(d) for d in dests)
        if total == 0:
            return
        headers = {"Range": f"bytes={offset}-{offset + total - 1}"}

        def once() -> None:
            self._request("GET", where, headers, None, dests, total)

        self._backoff.call(once, retry_on=(Unavailable,))

    def put(self, url: str, key: str, body: Bytes | Sequence[Bytes]) -> None:
        """Upload `body` to a presigned PUT URL (`key` names the object in errors)."""
        views = body_views(body)
        where = BlobLocation(key, url)

        def once() -> None:
            self._request("PUT", where, {}, GatherReader(views), [], 0)

        self._backoff.call(once, retry_on=(Unavailable,))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _request(
        self,
        method: str,
        where: BlobLocation,
        headers: dict[str, str],
        body: GatherReader | None,
        dests: Sequence[memoryview],
        total: int,
    ) -> None:
        action = "reading" if method == "GET" else "writing"
        if not where.url:
            raise InvalidArgument(f"no presigned URL for blob {where.key}", field="url")
        parts = urlsplit(where.url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        origin = (parts.scheme, parts.hostname or "", parts.port or 0)
        conn = self._acquire(origin)
        reusable = False
        try:
            if body is not None:
                headers = {**headers, "Content-Length": str(len(body))}
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            if response.status >= 300:
                document = response.read(_ERROR_BODY_LIMIT)
                reusable = response.isclosed()
                code, message = parse_error_document(document)
                raise s3_failure(response.status, code, message, where.key, action)
            if method == "GET":
                length = int(response.getheader("Content-Length") or -1)
                if length != total or (response.status == 200 and not headers["Range"].startswith(
                    "bytes=0-"
                )):
                    raise InvalidArgument(
                        f"{action} blob {where.key}: server sent {length} bytes for "
                        f"{headers['Range']}",
                        field=where.key,
                    )
                fill(response.readinto, dests, where.key)
            else:
                response.read()
            reusable = response.isclosed()
        except (OSError, http.client.HTTPException) as err:
            raise Unavailable(f"{action} blob {where.key}: {err!r}", field=where.key) from err
        finally:
            self._release(origin, conn, reusable)

    def _acquire(self, origin: _Origin) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                return idle.pop()
        scheme, host, port = origin
        if scheme == "https":
            return http.client.HTTPSConnection(
                host, port or None, timeout=self._timeout, context=self._ssl
            )
        if scheme != "http":
            raise InvalidArgument(f"presigned URL scheme {scheme!r} is not http(s)", field="url")
        return http.client.HTTPConnection(host, port or None, timeout=self._timeout)

    def _release(
        self, origin: _Origin, conn: http.client.HTTPConnection, reusable: bool
    ) -> None:
        if not reusable:
            conn.close()
            return
        with self._lock:
            self._idle.setdefault(origin, []).append(conn)
