"""fedhive's socket I/O for pika (bus/pika_io.py): every frame comes out whole, in order,
however the socket cut the stream into reads; a message goes out as pika would frame it,
however little of it each write takes."""

from __future__ import annotations

import contextlib
import itertools
import random
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from pika import exceptions, frame, spec

from fedhive.bus.codec import Parts
from fedhive.bus.pika_io import as_body, data_available, produce, send_message


@dataclass
class Connection:
    """What `data_available` uses of a pika connection."""

    _frame_buffer: Any = b""
    bytes_received: int = 0
    frames: list[bytes] = field(default_factory=list)

    def _process_frame(self, value: Any) -> None:
        self.frames.append(value.marshal())


def _stream() -> list[bytes]:
    """A delivery whose body spans frames, a heartbeat, and a one-frame delivery."""
    body = random.Random(7).randbytes(3 * 131_064 + 11)
    frames: list[frame.Frame] = [
        frame.Method(1, spec.Basic.Deliver("ctag", 1, False, "ex", "key")),
        frame.Header(1, len(body), spec.BasicProperties(type="fedhive.v1.X")),
        *(frame.Body(1, body[at:at + 131_064]) for at in range(0, len(body), 131_064)),
        frame.Heartbeat(),
        frame.Method(2, spec.Basic.Deliver("ctag", 2, False, "ex", "key")),
        frame.Header(2, 5, spec.BasicProperties()),
        frame.Body(2, b"hello"),
    ]
    return [value.marshal() for value in frames]


@pytest.mark.parametrize("cut", ["whole", "bytes", "sevens", "random"])
def test_frames_come_out_whole_however_the_reads_cut_them(cut: str) -> None:
    marshaled = _stream()
    stream = b"".join(marshaled)
    sizes = {"whole": [len(stream)], "bytes": [1], "sevens": [7, 8, 6],
             "random": [random.Random(3).randint(1, 300_000) for _ in range(64)]}[cut]
    connection, at, turn = Connection(), 0, 0
    while at < len(stream):
        size = sizes[turn % len(sizes)]
        data_available(connection, stream[at:at + size])  # type: ignore[arg-type]
        at, turn = at + size, turn + 1
    assert connection.frames == marshaled
    assert connection.bytes_received == len(stream)
    assert not connection._frame_buffer


def test_the_protocol_header_of_a_refusing_server_is_decoded() -> None:
    connection = Connection()
    data_available(connection, b"AMQP\x00\x00")  # type: ignore[arg-type]
    data_available(connection, b"\x09\x01")  # type: ignore[arg-type]
    assert connection.frames == [frame.ProtocolHeader().marshal()]


def test_a_body_frame_without_its_end_marker_is_refused() -> None:
    bad = frame.Body(1, b"payload").marshal()[:-1] + b"\x00"
    with pytest.raises(exceptions.InvalidFrameError):
        data_available(Connection(), bad)  # type: ignore[arg-type]


@dataclass
class Transport:
    """What `produce` uses of pika's plaintext transport."""

    _sock: socket.socket
    _tx_buffers: deque[Any] = field(default_factory=deque)
    _tx_buffered_byte_count: int = 0


@dataclass
class Sender:
    """What `send_message` uses of a pika connection."""

    transport: Transport
    _body_max_length: int = 131_064
    frames_sent: int = 0
    bytes_sent: int = 0

    def _adapter_emit_data(self, data: Any) -> None:
        self.transport._tx_buffers.append(data)
        self.transport._tx_buffered_byte_count += len(data)


def _in_parts(body: bytes) -> Parts:
    """`body` as a message and its attachment would give it: a small encoding, an empty
    part, a part ending inside a frame, one spanning a whole frame and the rest."""
    cuts = [0, 40, 40, 100_000, 100_000 + 2 * 131_064 + 5, len(body)]
    view = memoryview(body)
    return Parts(view[start:end] if n % 2 else bytes(view[start:end])
                 for n, (start, end) in enumerate(itertools.pairwise(cuts)))


@pytest.mark.parametrize("form", ["bytes", "parts"])
def test_a_message_goes_out_as_pika_frames_it_however_little_each_write_takes(
        form: str) -> None:
    body = random.Random(5).randbytes(3 * 131_064 + 11)
    method = spec.Basic.Publish(exchange="ex", routing_key="key")
    properties = spec.BasicProperties()
    expected = b"".join(value.marshal() for value in (
        frame.Method(1, method), frame.Header(1, len(body), properties),
        *(frame.Body(1, body[at:at + 131_064]) for at in range(0, len(body), 131_064))))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many partial writes
        ours.setblocking(False)
        sender = Sender(Transport(ours))
        sent = _in_parts(body) if form == "parts" else body
        send_message(sender, 1, method, (properties, sent))  # type: ignore[arg-type]
        received, writes = bytearray(), 0
        while sender.transport._tx_buffers:
            with contextlib.suppress(BlockingIOError):  # pika waits until it is writable
                produce(sender.transport)  # type: ignore[arg-type]
            writes += 1
            received += theirs.recv(1 << 20)
        theirs.setblocking(False)
        while len(received) < len(expected):
            received += theirs.recv(1 << 20)
    assert bytes(received) == expected
    assert writes > 10
    assert sender.transport._tx_buffered_byte_count == 0
    assert (sender.frames_sent, sender.bytes_sent) == (6, len(expected))


def test_basic_publish_takes_a_body_in_parts_as_it_is() -> None:
    parts = Parts([b"ab", memoryview(b"cd")])
    assert as_body(parts) is parts
    assert as_body("é") == "é".encode() and as_body(b"x") == b"x"  # pika's own conversions
