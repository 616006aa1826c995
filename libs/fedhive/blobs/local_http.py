"""The HTTP side of `LocalBlobStore`: presigned URLs, signed and served the way S3 serves them.

URLs look like S3's path-style presigned URLs (`http://127.0.0.1:<port>/<bucket>/<key>?
X-Amz-Date=..&X-Amz-Expires=..&X-Amz-SignedHeaders=..&X-Amz-Signature=..`, plus `partNumber`
and `uploadId` for a part), so the same readers and writers (`fedhive.blobs.http`,
`fedhive.blobs.upload`) use them through the same code. The signature is not SigV4: it is an
HMAC-SHA256, under a key made per server, over the method, the path, every other query field and
the signed headers' values (`host`, and `if-none-match` for a write-once PUT), so a URL can be
used for nothing but what it was made for, and not after it expired.

Answers are S3's for every case the readers tell apart: 206 with Content-Range for a range (416
InvalidRange past the end), 403 SignatureDoesNotMatch for a URL altered or used for another
method or key, 403 AccessDenied "Request has expired", 404 NoSuchKey / NoSuchUpload, 412
PreconditionFailed for a write-once PUT of a key that holds an object; bodies are S3's XML
error documents. Bodies are streamed: GETs with sendfile, PUTs to disk in 1 MiB reads.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit
from xml.sax.saxutils import escape

import structlog

from fedhive.blobs.local_folder import CHUNK, Folder
from fedhive.blobs.port import PresignedUrl
from fedhive.errors import AlreadyExists, BlobNotFound, InvalidArgument

log = structlog.get_logger()

SIGNATURE = "X-Amz-Signature"
_DATE = "%Y%m%dT%H%M%SZ"  # X-Amz-Date, as S3's: UTC, seconds
_REQUIRED = ("X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders", SIGNATURE)
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_PART_NUMBER = 10_000


class Refusal(Exception):
    """An S3 error answer: status, S3 error code, message (and extra headers)."""

    def __init__(self, status: int, code: str, message: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.headers = dict(headers or {})


class Signer:
    """Makes and checks URL signatures with a random key of its own (URLs die with it)."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def sign(self, method: str, host: str, path: str, expires_in: int,
             headers: Mapping[str, str], params: Mapping[str, str]) -> tuple[str, int]:
        """The query string of a URL for `method` on `path` (decoded, `/bucket/key`) at `host`
        that requests must send with `headers`; and when it expires (unix ms)."""
        signed_at = int(time.time())
        fields = {**params, "X-Amz-Date": time.strftime(_DATE, time.gmtime(signed_at)),
                  "X-Amz-Expires": str(expires_in),
                  "X-Amz-SignedHeaders": ";".join(sorted(["host", *headers]))}
        signature = self._digest(method, path, list(fields.items()), {"host": host, **headers})
        return urlencode({**fields, SIGNATURE: signature}), (signed_at + expires_in) * 1000

    def check(self, method: str, path: str, query: str,
              header: Callable[[str], str | None], now: float) -> None:
        """Raise the Refusal S3 gives a request whose URL was not made for it or expired."""
        pairs = parse_qsl(query, keep_blank_values=True)
        names = [name for name, _ in pairs]
        if any(names.count(name) != 1 for name in _REQUIRED):
            raise Refusal(400, "AuthorizationQueryParametersError",
                          f"Query-string authentication requires {', '.join(_REQUIRED)}, "
                          "once each")
        given = dict(pairs)
        signed = {name: header(name) or "" for name in given["X-Amz-SignedHeaders"].split(";")}
        expected = self._digest(method, path, [p for p in pairs if p[0] != SIGNATURE], signed)
        if not hmac.compare_digest(expected.encode(), given[SIGNATURE].encode()):
            raise Refusal(403, "SignatureDoesNotMatch", "The request signature we calculated "
                          "does not match the signature you provided.")
        # signed by us, so well formed: only the clock can refuse it now
        expires = calendar.timegm(time.strptime(given["X-Amz-Date"], _DATE))
        if now > expires + int(given["X-Amz-Expires"]):
            raise Refusal(403, "AccessDenied", "Request has expired")

    def _digest(self, method: str, path: str, fields: Sequence[tuple[str, str]],
                headers: Mapping[str, str]) -> str:
        lines = [method, path, urlencode(sorted(fields)),
                 *(f"{name.lower()}:{headers[name].strip()}" for name in sorted(headers))]
        return hmac.new(self._secret, "\n".join(lines).encode(), hashlib.sha256).hexdigest()


class UrlServer:
    """A threaded HTTP server on 127.0.0.1 (an ephemeral port) answering presigned requests
    for one bucket's `Folder`. Started at once; `close()` stops it and drops its connections."""

    def __init__(self, folder: Folder, bucket: str) -> None:
        self._httpd = _Httpd(folder, Signer(), bucket)
        # polled every 0.05 s: at most that long for close() to stop it
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        name="fedhive-local-blobs", daemon=True)
        self._thread.start()

    @property
    def url_prefix(self) -> str:
        """Scheme, host, port and bucket: what every URL of this server starts with."""
        return f"http://{self._httpd.host}/{quote(self._httpd.bucket, safe='')}"

    def presign(self, method: str, key: str, expires_in: int, *,
                headers: Mapping[str, str] | None = None,
                params: Mapping[str, str] | None = None) -> PresignedUrl:
        path = f"/{self._httpd.bucket}/{key}"
        query, expires_at_ms = self._httpd.signer.sign(
            method, self._httpd.host, path, expires_in, headers or {}, params or {})
        return PresignedUrl(f"{self.url_prefix}/{quote(key, safe='/~')}?{query}", expires_at_ms)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.drop_connections()
        self._thread.join()


_Request = socket.socket | tuple[bytes, socket.socket]


class _Httpd(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the readers open a connection per worker, all at once

    def __init__(self, folder: Folder, signer: Signer, bucket: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder, self.signer, self.bucket = folder, signer, bucket
        self.host = f"127.0.0.1:{self.server_address[1]}"
        self._open: set[socket.socket] = set()  # keep-alive connections, ended by close()
        self._lock = threading.Lock()

    def process_request(self, request: _Request, client_address: Any) -> None:
        if isinstance(request, socket.socket):
            with self._lock:
                self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: _Request) -> None:
        with self._lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: _Request, client_address: Any) -> None:
        # a client gone mid-answer: its loss, not the server's (socketserver prints a trace)
        log.debug("local blob connection failed", client=str(client_address), exc_info=True)

    def drop_connections(self) -> None:
        with self._lock:
            connections = list(self._open)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _BodyEnded(Exception):
    """The client stopped sending a request body before its Content-Length."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the readers' connection pools expect
    server_version = "fedhive-local-blobs"
    timeout = 120  # an idle keep-alive connection (one thread) ends after this
    server: _Httpd
    _unread = 0  # bytes of the request body not read yet

    def do_GET(self) -> None:
        self._answer("GET")

    def do_PUT(self) -> None:
        self._answer("PUT")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("local blob request", message=format % args)

    def _answer(self, method: str) -> None:
        self._unread = 0
        try:
            if method == "PUT":
                self._unread = self._content_length()
            target = urlsplit(self.path)
            path = unquote(target.path)
            self.server.signer.check(method, path, target.query, self.headers.get, time.time())
            key = path[1:].partition("/")[2]  # the path is signed: it is /<bucket>/<key>
            params = dict(parse_qsl(target.query))
            if method == "GET":
                self._get(key)
            elif "partNumber" in params or "uploadId" in params:
                self._put_part(key, params)
            else:
                self._put(key, self.headers.get("If-None-Match", "").strip() == "*")
        except Refusal as refusal:
            self._refuse(refusal)
        except _BodyEnded:
            self.close_connection = True
        except Exception as err:  # a bug or a disk failure: S3's 500, which readers retry
            log.exception("local blob request failed", path=self.path, error=str(err))
            self._refuse(Refusal(500, "InternalError", "We encountered an internal error."))

    def _content_length(self) -> int:
        length = self.headers.get("Content-Length", "")
        if self.headers.get("Transfer-Encoding") or not length.isdigit():
            self.close_connection = True  # where the body ends is unknown: so is the next one
            raise Refusal(411, "MissingContentLength",
                          "You must provide the Content-Length HTTP header.")
        return int(length)

    def _get(self, key: str) -> None:
        try:
            file = self.server.folder.open(key)
        except BlobNotFound as err:
            raise Refusal(404, "NoSuchKey", "The specified key does not exist.") from err
        with file:
            size = os.fstat(file.fileno()).st_size
            span = byte_range(self.headers.get("Range"), size)
            start, stop = span or (0, size)
            self.send_response(206 if span else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(stop - start))
            self.send_header("Accept-Ranges", "bytes")
            if span:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.end_headers()
            try:  # sendfile(count=0) would mean "to the end": an empty body sends nothing
                sent = self.connection.sendfile(file, start, stop - start) if stop > start else 0
            except OSError:
                sent = -1
            if sent != stop - start:  # the client left, or the file is shorter: end here
                self.close_connection = True

    def _put(self, key: str, write_once: bool) -> None:
        folder = self.server.folder
        digest = hashlib.md5(usedforsecurity=False)
        try:
            if write_once and folder.exists(key):  # refused before its body is stored
                raise AlreadyExists(key)
            folder.write(key, self._body(digest), write_once=write_once)
        except AlreadyExists as err:
            raise Refusal(412, "PreconditionFailed",
                          "At least one of the pre-conditions you specified did not hold") from err
        except BlobNotFound as err:
            raise Refusal(404, "NoSuchBucket", "The specified bucket does not exist") from err
        except InvalidArgument as err:
            raise Refusal(400, "InvalidArgument", str(err)) from err
        self._written(f'"{digest.hexdigest()}"')

    def _put_part(self, key: str, params: Mapping[str, str]) -> None:
        number = params.get("partNumber", "")
        if not number.isdigit() or not 1 <= int(number) <= _MAX_PART_NUMBER:
            raise Refusal(400, "InvalidArgument",
                          f"Part number must be an integer between 1 and {_MAX_PART_NUMBER}")
        no_upload = Refusal(404, "NoSuchUpload", "The specified upload does not exist. The "
                            "upload ID may be invalid, or the upload may have been aborted or "
                            "completed.")
        upload_id = params.get("uploadId", "")
        if not self.server.folder.has_upload(key, upload_id):
            raise no_upload
        try:
            etag = self.server.folder.write_part(key, upload_id, int(number), self._body())
        except InvalidArgument as err:  # aborted or completed meanwhile
            raise no_upload from err
        self._written(etag)

    def _body(self, digest: Any = None) -> Iterator[memoryview]:
        """The request body in pieces of at most CHUNK bytes (one buffer, reused)."""
        buffer = memoryview(bytearray(min(CHUNK, self._unread)))
        while self._unread:
            piece = buffer[: min(len(buffer), self._unread)]
            try:
                n = self.rfile.readinto(piece)
            except OSError as err:
                raise _BodyEnded from err
            if not n:
                raise _BodyEnded
            self._unread -= n
            if digest is not None:
                digest.update(piece[:n])
            yield piece[:n]

    def _written(self, etag: str) -> None:
        self.send_response(200)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _refuse(self, refusal: Refusal) -> None:
        try:
            for _ in self._body():  # the unread body, dropped: the connection stays usable
                pass
        except _BodyEnded:
            self.close_connection = True
            return  # the client left: nobody to answer
        document = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{refusal.code}'
                    f"</Code><Message>{escape(refusal.message)}</Message><Resource>"
                    f"{escape(self.path)}</Resource></Error>").encode()
        self.send_response(refusal.status)
        for name, value in {**refusal.headers, "Content-Type": "application/xml",
                            "Content-Length": str(len(document))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(document)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, stop) of an object of `size` bytes that a Range header asks for, as S3 reads
    it: None (the whole object, 200) when absent, malformed or several ranges; Refusal 416
    when it starts past the end."""
    found = _RANGE.match(header.strip()) if header else None
    if found is None or found.groups() == ("", ""):
        return None
    first, last = found.groups()
    unsatisfiable = Refusal(416, "InvalidRange", "The requested range is not satisfiable",
                            {"Content-Range": f"bytes */{size}"})
    if not first:  # "bytes=-n": the last n bytes
        if int(last) == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - int(last)), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise unsatisfiable
    return start, size if not last else min(int(last) + 1, size)
