"""fedhive's frame decoding for pika (bus/pika_io.py): every frame comes out whole, in order,
however the socket cut the stream into reads."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from pika import exceptions, frame, spec

from fedhive.bus.pika_io import data_available


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
