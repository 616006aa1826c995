"""Presigned HTTP transfers against a scripted local server: timeouts measure lack of progress
(a slow transfer that keeps moving completes however long it takes, a stalled one fails), and
content keys are checked."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fedhive.blobs import BlobLocation, PresignedFetcher, PresignedUploader, content_key
from fedhive.errors import InvalidArgument, Unavailable
from fedhive.retry import Backoff

ONCE = Backoff(max_attempts=1)  # no retry may hide a timeout
STALL = 0.5  # seconds without progress that count as a stall
Script = Callable[[socket.socket, threading.Event], None]


class Server:
    """Accepts connections on localhost and runs `script` on each one."""

    def __init__(self, script: Script, rcvbuf: int | None = None) -> None:
        self.listener = socket.socket()
        if rcvbuf:  # inherited by accepted sockets: a small window makes the client wait on us
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.done = threading.Event()
        self.connections = 0
        self.script = script
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/bucket/key?X-Amz-Signature=s"

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.script(conn, self.done)

    def close(self) -> None:
        self.done.set()
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(script: Script, rcvbuf: int | None = None) -> Server:
        servers.append(Server(script, rcvbuf))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def read_head(conn: socket.socket) -> dict[str, str]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(1)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    lines = data.decode().split("\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}


BODY = bytes(range(256)) * 160  # 40 KiB


def trickle(conn: socket.socket, done: threading.Event) -> None:
    """Answers a GET with 1 KiB every 50 ms: about 2 s in all, four times the stall timeout."""
    read_head(conn)
    conn.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(BODY)}\r\n\r\n".encode())
    for start in range(0, len(BODY), 1024):
        conn.sendall(BODY[start : start + 1024])
        time.sleep(0.05)


def stall_halfway(conn: socket.socket, done: threading.Event) -> None:
    read_head(conn)
    conn.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(BODY)}\r\n\r\n".encode())
    conn.sendall(BODY[: len(BODY) // 2])
    done.wait(30)


def test_a_slow_download_that_keeps_moving_completes(serve: Callable[..., Server]) -> None:
    server = serve(trickle)
    fetcher = PresignedFetcher(stall_timeout=STALL, backoff=ONCE)
    dest = bytearray(len(BODY))
    fetcher.fetch_range(BlobLocation("ns/slow", server.url), 0, [memoryview(dest)])
    assert bytes(dest) == BODY and fetcher.bytes_fetched == len(BODY)
    fetcher.close()


def test_a_stalled_download_fails_and_is_retried(serve: Callable[..., Server]) -> None:
    server = serve(stall_halfway)
    fetcher = PresignedFetcher(stall_timeout=STALL, backoff=Backoff(base=0.01, max_attempts=2))
    with pytest.raises(Unavailable, match="ns/stuck: no progress"):
        fetcher.fetch_range(BlobLocation("ns/stuck", server.url), 0,
                            [memoryview(bytearray(len(BODY)))])
    assert server.connections == 2 and fetcher.bytes_fetched == 0
    fetcher.close()


UPLOAD = 8 * 1024 * 1024


def slow_reader(conn: socket.socket, done: threading.Event) -> None:
    """Reads an upload 64 KiB every 20 ms (over 2.5 s for 8 MiB), then answers with an ETag."""
    head = read_head(conn)
    left = int(head["content-length"])
    while left:
        left -= len(conn.recv(min(left, 64 * 1024)))
        time.sleep(0.02)
    conn.sendall(b'HTTP/1.1 200 OK\r\nETag: "abc"\r\nContent-Length: 0\r\n\r\n')


def never_reads(conn: socket.socket, done: threading.Event) -> None:
    read_head(conn)
    done.wait(30)


def test_a_slow_upload_that_keeps_moving_completes(serve: Callable[..., Server]) -> None:
    server = serve(slow_reader, rcvbuf=32 * 1024)
    uploader = PresignedUploader(stall_timeout=STALL, backoff=ONCE)
    uploader.put(server.url, "ns/slow-up", bytes(UPLOAD))
    assert uploader.bytes_sent == UPLOAD
    uploader.close()


def test_a_stalled_upload_fails(serve: Callable[..., Server]) -> None:
    server = serve(never_reads, rcvbuf=32 * 1024)
    uploader = PresignedUploader(stall_timeout=STALL, backoff=ONCE)
    with pytest.raises(Unavailable, match="ns/stuck-up"):
        uploader.put(server.url, "ns/stuck-up", bytes(UPLOAD))
    assert uploader.bytes_sent == 0
    uploader.close()


def test_an_answer_that_never_comes_after_the_body_is_a_stall(
    serve: Callable[..., Server],
) -> None:
    def swallow(conn: socket.socket, done: threading.Event) -> None:
        head = read_head(conn)
        left = int(head["content-length"])
        while left:
            left -= len(conn.recv(left))
        done.wait(30)

    server = serve(swallow)
    uploader = PresignedUploader(stall_timeout=STALL, backoff=ONCE)
    with pytest.raises(Unavailable, match="no progress"):
        uploader.put(server.url, "ns/silent", b"small body")
    uploader.close()


def test_content_keys_name_the_hash() -> None:
    digest = "ab" * 32
    assert content_key("ns/jobs/j1/tensors/", f"blake3:{digest}") == (
        f"ns/jobs/j1/tensors/blake3/{digest}"
    )
    # a checkpoint written while sha256 named objects still names its objects
    assert content_key("ns/", f"sha256:{digest}") == f"ns/sha256/{digest}"
    for bad in ("blake3:" + "AB" * 32, "blake3:" + "ab" * 31, "blake2b:" + "ab" * 32,
                "ab" * 32, f"blake3:{digest}/../x", f"sha512:{digest}"):
        with pytest.raises(InvalidArgument, match="is not 'blake3:<64 hex digits>'"):
            content_key("ns/", bad)
