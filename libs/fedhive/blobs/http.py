"""Credential-free blob access through presigned URLs, over plain HTTP(S).

Trainers and sites hold no S3 credentials (DESIGN §5, §7): they read objects only through the
presigned URLs in refs (`PresignedFetcher`) and write them through presigned PUTs
(`fedhive.blobs.upload.PresignedUploader`). Both go through an `HttpPool`: http.client used
directly, with a few keep-alive connections per host, because its `readinto` moves bytes from
the socket straight into the destination buffer (no per-chunk copies).

Timeouts measure lack of progress, never total duration: `stall_timeout` is the socket timeout,
which bounds each socket operation (connect, one `recv`, one `sendall` of a `BLOCK`-sized piece
of a body). Once an upload's body is handed to the kernel, the wait for S3's answer counts the
send queue draining (Linux `TIOCOUTQ`: bytes the peer has not acknowledged yet) as progress,
so megabytes still buffered on a slow link do not look like a stall. A slow transfer that keeps
moving is never cut off, however long it takes; one that stalls fails within about
`stall_timeout` and is retried (`fedhive.retry.Backoff`). A server certificate that fails
verification is a one-line `ConfigError` at once: no retry gets past it.

Expired URLs: a `PresignedFetcher` given `resign` (a callable: keys -> fresh `PresignedUrl`s,
e.g. an RPC to the server job that issued the refs) asks for new URLs before using one that is
missing or expires within `resign_margin_s`, and once more, then retries, when S3 answers 403.
"""

from __future__ import annotations

import http.client
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import structlog

from fedhive.blobs.failures import parse_error_document, s3_failure
from fedhive.blobs.port import BlobLocation, Bytes, PresignedUrl
from fedhive.blobs.transfer import GatherReader, body_views, fill
from fedhive.errors import BlobAccessDenied, ConfigError, InvalidArgument, Unavailable
from fedhive.retry import Backoff

T = TypeVar("T")
log = structlog.get_logger()

BLOCK = 64 * 1024  # bytes per `sendall` of an upload body: the unit the stall timeout watches
_ERROR_BODY_LIMIT = 64 * 1024
_MAX_FRESH = 100_000  # re-signed URLs kept (oldest dropped first)
_Origin = tuple[str, str, int]
Resign = Callable[[list[str]], Mapping[str, PresignedUrl]]


class HttpPool:
    """Keep-alive HTTP(S) connections per origin, shared by threads; `close()` drops them."""

    def __init__(
        self, *, stall_timeout: float = 60.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._timeout = stall_timeout
        self._ssl = ssl_context or ssl.create_default_context()
        self._idle: dict[_Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def exchange(
        self,
        method: str,
        url: str,
        key: str,
        headers: Mapping[str, str],
        body: GatherReader | None,
        on_success: Callable[[http.client.HTTPResponse], T],
    ) -> T:
        """One request to a presigned `url` (of object `key`, named in errors); `on_success`
        consumes a 2xx response. An S3 error answer raises its typed error (`s3_failure`); a
        connection failure or stall raises Unavailable, which callers retry."""
        action = "reading" if method == "GET" else "writing"
        if not url:
            raise InvalidArgument(f"no presigned URL for blob {key}", field="url")
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        origin = (parts.scheme, parts.hostname or "", parts.port or 0)
        conn = self._acquire(origin)
        reusable = False
        try:
            sent = dict(headers)
            if body is not None:
                sent["Content-Length"] = str(len(body))
            conn.request(method, target, body=body, headers=sent)
            if body is not None:
                self._await_answer(conn)
            response = conn.getresponse()
            if response.status >= 300:
                document = response.read(_ERROR_BODY_LIMIT)
                reusable = response.isclosed()
                code, message = parse_error_document(document)
                raise s3_failure(response.status, code, message, key, action)
            result = on_success(response)
            reusable = response.isclosed()
            return result
        except TimeoutError as err:
            raise Unavailable(
                f"{action} blob {key}: no progress for {self._timeout:g}s", field=key
            ) from err
        except ssl.SSLCertVerificationError as err:  # no retry gets past it: say so at once
            raise ConfigError(
                f"{action} blob {key}: the TLS certificate of {parts.hostname} is refused "
                f"({err.verify_message}): trust its CA (AWS_CA_BUNDLE for the services, "
                "SSL_CERT_FILE where presigned URLs are read) and check that the URL's host is "
                "a name on the certificate", field=key) from err
        except (OSError, http.client.HTTPException) as err:
            raise Unavailable(f"{action} blob {key}: {err!r}", field=key) from err
        finally:
            self._release(origin, conn, reusable)

    def _await_answer(self, conn: http.client.HTTPConnection) -> None:
        """Wait until S3 starts answering; TimeoutError after `stall_timeout` seconds in which
        neither an answer came nor the peer acknowledged more of the body."""
        sock = conn.sock
        if sock is None or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            unacked = _unacknowledged(sock)
            while not selector.select(self._timeout):
                now = _unacknowledged(sock)
                if now is None or unacked is None or now >= unacked:
                    raise TimeoutError("no answer and no bytes acknowledged")
                unacked = now

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _acquire(self, origin: _Origin) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                return idle.pop()
        scheme, host, port = origin
        if scheme == "https":
            return http.client.HTTPSConnection(
                host, port or None, timeout=self._timeout, context=self._ssl, blocksize=BLOCK
            )
        if scheme != "http":
            raise InvalidArgument(f"presigned URL scheme {scheme!r} is not http(s)", field="url")
        return http.client.HTTPConnection(host, port or None, timeout=self._timeout,
                                          blocksize=BLOCK)

    def _release(
        self, origin: _Origin, conn: http.client.HTTPConnection, reusable: bool
    ) -> None:
        if not reusable:
            conn.close()
            return
        with self._lock:
            self._idle.setdefault(origin, []).append(conn)


def put_object(
    pool: HttpPool,
    backoff: Backoff,
    url: str,
    key: str,
    views: Sequence[memoryview],
    headers: Mapping[str, str] | None = None,
) -> str:
    """PUT the concatenation of `views` to a presigned URL with `headers` (those it was signed
    with, e.g. `WRITE_ONCE_HEADERS`), retrying transient failures; returns the ETag S3
    answered (empty if none)."""

    def answered(response: http.client.HTTPResponse) -> str:
        response.read()
        return response.getheader("ETag") or ""

    def once() -> str:
        return pool.exchange("PUT", url, key, headers or {}, GatherReader(views), answered)

    def on_retry(err: BaseException, wait: float) -> None:
        log.warning("presigned upload retried", key=key, error=str(err), wait=wait)

    return backoff.call(once, retry_on=(Unavailable,), on_retry=on_retry)


class PresignedFetcher:
    """A `RangeFetcher` that needs no credentials, only the URLs it is given; thread-safe.

    `resign(keys) -> {key: PresignedUrl}` (optional) renews URLs that are missing, expire
    within `resign_margin_s`, or that S3 refuses (403): asked once per refusal, then the read
    is retried with the new URL. Without it an expired URL is BlobAccessDenied.
    `bytes_fetched` counts the bytes of successful reads (for tests and benchmarks).
    """

    def __init__(
        self,
        *,
        stall_timeout: float = 60.0,
        backoff: Backoff | None = None,
        ssl_context: ssl.SSLContext | None = None,
        resign: Resign | None = None,
        resign_margin_s: float = 60.0,
        pool: HttpPool | None = None,
        keep_urls: int = _MAX_FRESH,
    ) -> None:
        self._pool = pool or HttpPool(stall_timeout=stall_timeout, ssl_context=ssl_context)
        self._owns_pool = pool is None
        self._backoff = backoff or Backoff()
        self._resign = resign
        self._margin_ms = int(resign_margin_s * 1000)
        self._fresh: dict[str, PresignedUrl] = {}  # key -> the newest URL `resign` gave
        self._keep = keep_urls  # at most this many (oldest dropped first)
        self._lock = threading.Lock()
        self._resign_lock = threading.Lock()  # one resign call at a time: no duplicate asks
        self._bytes = 0
        self._resigned = 0

    @property
    def bytes_fetched(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def urls_resigned(self) -> int:
        """How many keys `resign` was asked for, in all."""
        with self._lock:
            return self._resigned

    def prepare(self, wheres: Sequence[BlobLocation]) -> None:
        """Renew, in one `resign` call, the URLs of `wheres` that are missing or about to expire
        (`unpack` calls this before reading, so a model of many tensors costs one call)."""
        if self._resign is None:
            return
        stale = sorted({w.key for w in wheres if self._due(w)})
        if stale:
            with self._resign_lock:
                self._ask(stale)

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        total = sum(len(d) for d in dests)
        if total == 0:
            return
        headers = {"Range": f"bytes={offset}-{offset + total - 1}"}

        def received(response: http.client.HTTPResponse) -> None:
            length = int(response.getheader("Content-Length") or -1)
            if length != total or (response.status == 200 and offset != 0):
                raise InvalidArgument(
                    f"reading blob {where.key}: server sent {length} bytes for "
                    f"{headers['Range']}",
                    field=where.key,
                )
            fill(response.readinto, dests, where.key)

        self._get(where, headers, received)
        with self._lock:
            self._bytes += total

    def length(self, where: BlobLocation) -> int:
        """The object's size, from a one-byte ranged read through its GET URL (no HEAD URL to
        sign: a reader that checks an object and then reads it signs once). An empty object
        has no byte to read: S3 answers 416 (InvalidArgument)."""

        def received(response: http.client.HTTPResponse) -> int:
            response.read()
            if response.status == 200:  # the whole object: the server ignored the range
                return int(response.getheader("Content-Length") or 0)
            total = (response.getheader("Content-Range") or "").rpartition("/")[2]
            if not total.isdigit():
                raise InvalidArgument(f"reading blob {where.key}: no object size in the answer "
                                      f"to a ranged read", field=where.key)
            return int(total)

        return self._get(where, {"Range": "bytes=0-0"}, received)

    def _get(self, where: BlobLocation, headers: Mapping[str, str],
             received: Callable[[http.client.HTTPResponse], T]) -> T:
        """A GET of the object through its best URL, renewed before when due and once more
        when S3 refuses it."""

        def get(url: str) -> T:
            return self._backoff.call(
                lambda: self._pool.exchange("GET", url, where.key, headers, None, received),
                retry_on=(Unavailable,),
            )

        url = self._best(where)
        if self._resign is not None and self._due(where):
            url = self._renew(where.key, url)
        try:
            return get(url.url)
        except BlobAccessDenied:
            if self._resign is None:
                raise
            log.info("presigned url refused; re-signing", key=where.key)
            return get(self._renew(where.key, url).url)

    def put(self, url: str, key: str, body: Bytes | Sequence[Bytes]) -> None:
        """Upload `body` to a presigned PUT URL (`key` names the object in errors). Kept for
        callers that already hold a fetcher; `PresignedUploader` also does multipart."""
        put_object(self._pool, self._backoff, url, key, body_views(body))

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()

    # --- internals ---------------------------------------------------------------------------
    def _best(self, where: BlobLocation) -> PresignedUrl:
        """The ref's URL, or the one `resign` gave for the key if that lives longer."""
        given = PresignedUrl(where.url, where.expires_at_ms)
        with self._lock:
            fresh = self._fresh.get(where.key)
        if fresh is None or (given.url and given.expires_at_ms >= fresh.expires_at_ms):
            return given
        return fresh

    def _due(self, where: BlobLocation) -> bool:
        """Renew before use: the ref has no URL, or one about to expire, and `resign` gave
        none for this key yet. (URLs from `resign` are renewed only when S3 refuses them: with
        the clocks of site and server apart, their expiry may look near all the time.)"""
        with self._lock:
            if where.key in self._fresh:
                return False
        return self._expiring(PresignedUrl(where.url, where.expires_at_ms))

    def _expiring(self, url: PresignedUrl) -> bool:
        if not url.url:
            return True
        return bool(url.expires_at_ms) and url.expires_at_ms - _now_ms() < self._margin_ms

    def _renew(self, key: str, stale: PresignedUrl) -> PresignedUrl:
        """A new URL for `key`: from `resign`, unless another thread already renewed it."""
        with self._resign_lock:
            with self._lock:
                fresh = self._fresh.get(key)
            if fresh is not None and fresh.url != stale.url:
                return fresh  # another thread renewed it meanwhile
            return self._ask([key])[key]

    def _ask(self, keys: list[str]) -> dict[str, PresignedUrl]:
        assert self._resign is not None
        answer = self._resign(list(keys))
        for key in keys:
            url = answer.get(key)
            if url is None or not url.url:
                raise BlobAccessDenied(
                    f"re-signing blob {key}: the issuer returned no URL for it", field=key
                )
        fresh = {key: answer[key] for key in keys}
        with self._lock:
            for key in keys:
                self._fresh.pop(key, None)  # re-inserted last: the map is oldest-first
            self._fresh.update(fresh)
            while len(self._fresh) > self._keep:
                del self._fresh[next(iter(self._fresh))]
            self._resigned += len(keys)
        log.debug("presigned urls renewed", keys=len(keys))
        return fresh


def _unacknowledged(sock: socket.socket) -> int | None:
    """Bytes in the socket's send queue (sent or not, not acknowledged); None where unknown."""
    try:
        import fcntl
        import termios

        answer = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    except (ImportError, OSError, AttributeError):  # not Linux / not a socket queue we can see
        return None
    value: int = struct.unpack("i", answer)[0]
    return value


def _now_ms() -> int:
    return int(time.time() * 1000)
