"""The local pipe between a client job and its trainer: framed `ClientMessage`s on a socket.

Each frame is a 4-byte big-endian length and one serialized `fedhive.v1.ClientMessage` (see
proto/fedhive/v1/client.proto). Frames are small (refs and metadata; inline arrays at most the
inline budget), and a frame larger than `max_frame` is refused on both ends.

`Pipe` is thread-safe for writers (one lock) and meant for one reader thread. `Requests` pairs
requests with replies by `seq` for a side that asks several things at once (a trainer's
parallel downloads re-signing URLs while it uploads).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from concurrent.futures import Future
from typing import Any

from google.protobuf.message import DecodeError

from fedhive.errors import FedhiveError, MalformedMessage, Unavailable, from_code
from fedhive.proto.v1 import client_pb2, common_pb2

ENV_FD = "FEDHIVE_CLIENT_FD"  # the trainer's end of the socketpair
ENV_JOB_ID = "FEDHIVE_JOB_ID"
ENV_SITE = "FEDHIVE_SITE"
ENV_WORKSPACE = "FEDHIVE_WORKSPACE"
MAX_FRAME = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")

Message = client_pb2.ClientMessage


class PipeClosed(Unavailable):
    """The other end went away (EOF, or the socket failed)."""


class Pipe:
    def __init__(self, sock: socket.socket, *, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self._max_frame = max_frame
        self._write = threading.Lock()
        self._closed = False

    def send(self, message: Message) -> None:
        """Write one frame; PipeClosed when the other end is gone."""
        body = message.SerializeToString()
        if len(body) > self._max_frame:
            raise MalformedMessage(f"pipe message of {len(body)} bytes exceeds the "
                                   f"{self._max_frame}-byte limit", field="body")
        with self._write:
            try:
                self.sock.sendall(_HEADER.pack(len(body)) + body)
            except OSError as err:
                raise PipeClosed(f"the pipe is closed: {err}", field="pipe") from err

    def recv(self) -> Message | None:
        """The next frame; None at a clean EOF (between frames). PipeClosed for EOF inside a
        frame, MalformedMessage for an oversized or undecodable one."""
        header = self._read(_HEADER.size, eof_ok=True)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length > self._max_frame:
            raise MalformedMessage(f"pipe frame of {length} bytes exceeds the "
                                   f"{self._max_frame}-byte limit", field="length")
        body = self._read(length, eof_ok=False) or b""
        message = Message()
        try:
            message.ParseFromString(body)
        except DecodeError as err:
            raise MalformedMessage(f"pipe frame does not decode as ClientMessage: {err}",
                                   field="body") from err
        return message

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _read(self, size: int, *, eof_ok: bool) -> bytes | None:
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            try:
                n = self.sock.recv_into(view[done:])
            except OSError as err:
                raise PipeClosed(f"the pipe is closed: {err}", field="pipe") from err
            if n == 0:
                if done == 0 and eof_ok:
                    return None
                raise PipeClosed(f"the pipe closed inside a frame ({done} of {size} bytes)",
                                 field="pipe")
            done += n
        return bytes(buffer)


def error_reply(seq: int, err: BaseException) -> Message:
    """The `error` reply to request `seq`: a FedhiveError keeps its code and field."""
    if isinstance(err, FedhiveError):
        body = common_pb2.Error(code=err.code, message=str(err), field=err.field or "")
    else:
        text = " ".join(f"{type(err).__name__}: {err}".split())
        body = common_pb2.Error(code="INTERNAL", message=text)
    return Message(seq=seq, error=body)


class Requests:
    """Requests in flight on a pipe, answered by the reader thread calling `answer`."""

    def __init__(self, pipe: Pipe) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, Future[Message]] = {}
        self._gone: BaseException | None = None

    def call(self, timeout: float | None = None, **body: Any) -> Message:
        """Send a request (one `body` field, e.g. `resign=ResignRequest(...)`) and wait for its
        reply. An `error` reply is raised as its typed FedhiveError; PipeClosed when the pipe
        goes away first."""
        future: Future[Message] = Future()
        with self._lock:
            if self._gone is not None:
                raise PipeClosed(f"the pipe is closed: {self._gone}", field="pipe")
            self._next += 1
            seq = self._next
            self._waiting[seq] = future
        try:
            self._pipe.send(Message(seq=seq, **body))
            reply = future.result(timeout)
        finally:
            with self._lock:
                self._waiting.pop(seq, None)
        if reply.WhichOneof("body") == "error":
            raise from_code(reply.error.code, reply.error.message, reply.error.field)
        return reply

    def answer(self, message: Message) -> bool:
        """Hand a reply to its waiting caller; False when no request has that seq."""
        with self._lock:
            future = self._waiting.get(message.seq)
        if future is None:
            return False
        future.set_result(message)
        return True

    def fail_all(self, reason: BaseException) -> None:
        """The pipe is gone: every waiting call (and every later one) raises PipeClosed."""
        with self._lock:
            self._gone = reason
            waiting = list(self._waiting.values())
        for future in waiting:
            if not future.done():
                future.set_exception(PipeClosed(f"the pipe is closed: {reason}", field="pipe"))
