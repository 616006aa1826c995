"""A byte-counting TCP proxy: what the sites see as S3, in front of the real S3 server.

    proxy = CountingProxy(("127.0.0.1", 8333), attribute=who_is)   # (peer, local) -> label
    proxy.start()
    ... presigned URLs for proxy.endpoint_url (FEDHIVE_S3_PUBLIC_ENDPOINT_URL) ...
    proxy.totals()                    # {label: {"down": bytes, "up": bytes}}
    proxy.totals(since=t0, until=t1)  # the bytes that moved between two time.time() values
    proxy.stop()

It forwards bytes unchanged in both directions (HTTP, TLS, anything), so a presigned URL
signed for the proxy's address is valid through it: the Host header the S3 server checks is
the one the URL was signed for. `down` counts bytes from S3 to the client, `up` from the
client to S3, headers included (a few hundred bytes per request). Each connection is labelled
once by `attribute(peer address, proxy address)`, its two ends (a client's port may be in use
towards other servers at the same time), called when it is accepted, before any byte is
forwarded (the benchmark finds the process that owns the client socket: a few ms per
connection, and clients keep their connections alive across requests).

On Linux the bytes move with splice(2) through a pipe, kernel to kernel: the proxy costs a
few percent of a core at hundreds of MiB/s and never holds more than a pipe's worth.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable

PIPE_SIZE = 1024 * 1024
BUCKET_S = 0.01  # time resolution of the counters
UNKNOWN = "unknown"
Address = tuple[str, int]
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class CountingProxy:
    def __init__(self, upstream: Address, *,
                 attribute: Callable[[Address, Address], str] | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self._attribute = attribute
        self._listener = socket.create_server((host, port), backlog=256)
        self.address: Address = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        # (connection id, direction, time bucket) -> bytes
        self._moved: dict[tuple[int, str, int], int] = defaultdict(int)
        self._labels: dict[int, str] = {}
        self._ids = itertools.count()
        self._open: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    @property
    def endpoint_url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> CountingProxy:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(5)
        with self._lock:
            still_open = list(self._open)
        for sock in still_open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # counters -------------------------------------------------------------------------------
    def totals(self, since: float | None = None, until: float | None = None,
               ) -> dict[str, dict[str, int]]:
        """{label: {"down": bytes, "up": bytes}} for bytes moved in [since, until) (time.time()
        values, to the counters' 10 ms resolution); the whole run without bounds."""
        low = -1 if since is None else int(since / BUCKET_S)
        high = None if until is None else int(until / BUCKET_S)
        found: dict[str, dict[str, int]] = {}
        with self._lock:
            for (conn, direction, bucket), count in self._moved.items():
                if bucket < low or (high is not None and bucket >= high):
                    continue
                label = self._labels.get(conn, UNKNOWN)
                entry = found.setdefault(label, {"down": 0, "up": 0})
                entry[direction] += count
        return found

    def spans(self, since: float | None = None, until: float | None = None, *,
              min_bucket_bytes: int = 16 * 1024,
              ) -> dict[str, dict[str, tuple[float, float, int]]]:
        """{label: {direction: (first, last, bytes)}}: when the first and the last bulk bytes
        in [since, until) moved (time.time(); the start of the first and the end of the last
        10 ms bucket of a label and direction holding at least `min_bucket_bytes`, which leaves
        out the headers of requests and replies going the other way) and how many bytes."""
        low = -1 if since is None else int(since / BUCKET_S)
        high = None if until is None else int(until / BUCKET_S)
        buckets: dict[tuple[str, str, int], int] = defaultdict(int)
        with self._lock:
            for (conn, direction, bucket), count in self._moved.items():
                if bucket < low or (high is not None and bucket >= high):
                    continue
                buckets[(self._labels.get(conn, UNKNOWN), direction, bucket)] += count
        found: dict[str, dict[str, tuple[float, float, int]]] = {}
        for (label, direction, bucket), count in buckets.items():
            first, last, total = found.setdefault(label, {}).get(
                direction, (float("inf"), 0.0, 0))
            if count >= min_bucket_bytes:
                first, last = min(first, bucket * BUCKET_S), max(last, (bucket + 1) * BUCKET_S)
            found[label][direction] = (first, last, total + count)
        return found

    def connections(self) -> dict[str, int]:
        """How many connections each label opened."""
        with self._lock:
            labels = list(self._labels.values())
        counted: dict[str, int] = defaultdict(int)
        for label in labels:
            counted[label] += 1
        return dict(counted)

    def _count(self, conn: int, direction: str, count: int) -> None:
        bucket = int(time.time() / BUCKET_S)
        with self._lock:
            self._moved[(conn, direction, bucket)] += count

    # plumbing -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, peer), daemon=True,
                             name="proxy-conn").start()

    def _serve(self, client: socket.socket, peer: Address) -> None:
        conn = next(self._ids)
        label = self._label(peer, client.getsockname()[:2])
        with self._lock:
            self._labels[conn] = label
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._open.update((client, server))
        up = threading.Thread(target=self._pump, args=(client, server, conn, "up"), daemon=True,
                              name="proxy-up")
        up.start()
        self._pump(server, client, conn, "down")
        up.join()
        with self._lock:
            self._open.difference_update((client, server))
        client.close()
        server.close()

    def _label(self, peer: Address, local: Address) -> str:
        if self._attribute is None:
            return UNKNOWN
        try:
            return self._attribute(peer, local)
        except Exception:  # a label is a nicety: the bytes are counted under "unknown"
            return UNKNOWN

    def _pump(self, source: socket.socket, dest: socket.socket, conn: int, direction: str) -> None:
        """Move bytes until `source` closes, then half-close `dest`."""
        try:
            if hasattr(os, "splice"):
                self._splice(source, dest, conn, direction)
            else:
                self._copy(source, dest, conn, direction)
        except OSError:
            with contextlib.suppress(OSError):
                source.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            dest.shutdown(socket.SHUT_WR)

    def _splice(self, source: socket.socket, dest: socket.socket, conn: int,
                direction: str) -> None:
        read_end, write_end = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_SIZE)
            src, dst = source.fileno(), dest.fileno()
            while True:
                moved = os.splice(src, write_end, PIPE_SIZE)
                if moved == 0:
                    return
                left = moved
                while left:
                    left -= os.splice(read_end, dst, left)
                self._count(conn, direction, moved)
        finally:
            os.close(read_end)
            os.close(write_end)

    def _copy(self, source: socket.socket, dest: socket.socket, conn: int,
              direction: str) -> None:
        buffer = memoryview(bytearray(256 * 1024))
        while True:
            moved = source.recv_into(buffer)
            if moved == 0:
                return
            dest.sendall(buffer[:moved])
            self._count(conn, direction, moved)
