"""Protobuf on the wire: the type registry a consumer accepts, and errors as `fedhive.v1.Error`.

The AMQP `type` property carries the protobuf full name; a consumer decodes only the types it
registered, so a message of any other type is malformed for it (and dead-lettered).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from fedhive.errors import FedhiveError, MalformedMessage, from_code
from fedhive.proto.v1 import common_pb2

CONTENT_TYPE = "application/x-protobuf"
ERROR_TYPE = common_pb2.Error.DESCRIPTOR.full_name
HEAD_HEADER = "x-fedhive-head"  # an `Encoded` reply's own part, merged over its shared body
# A head larger than this is joined to the body instead: AMQP carries a message's headers in
# one frame (at most frame_max, 128 KiB on RabbitMQ), and a task's props may be large.
HEAD_MAX = 32 * 1024
# An `Encoded` message's attachment: raw bytes after its protobuf encoding in the AMQP body (the
# header gives their length), which its TensorRefs name (`attached`) instead of holding copies.
ATTACHED_HEADER = "x-fedhive-attached"
NO_ATTACHMENT = memoryview(b"")

M = TypeVar("M", bound=Message)


def type_name(message: Message | type[Message]) -> str:
    """The protobuf full name, e.g. `fedhive.v1.DeployRequest`: the AMQP `type` property."""
    return message.DESCRIPTOR.full_name


class Parts:
    """A body in pieces (a protobuf encoding, then an attachment's buffers) that no one joins:
    the pika transport writes its frames from the pieces (`fedhive.bus.pika_io`), the
    in-memory bus joins them (`joined`). Joining a 1 MiB result cost its sender a copy into
    fresh pages (~7-12 % of a light host's CPU at 100 sites). The buffers must not change
    until the message is written: pika's blocking publish returns only then."""

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: Iterable[bytes | memoryview]) -> None:
        self.pieces = tuple(pieces)
        self.size = sum(len(piece) for piece in self.pieces)  # byte views only (Attachment)

    def __len__(self) -> int:
        return self.size


Body = bytes | Parts


def joined(body: Body) -> bytes:
    """`body` in one piece."""
    return b"".join(body.pieces) if isinstance(body, Parts) else body


@dataclass(frozen=True)
class Encoded:
    """A message its sender serialized itself.

    * A reply whose large part many callers share is encoded once (`body`, the same object for
      every caller) and each caller's small part (`head`) travels beside it, in the AMQP header
      `HEAD_HEADER`; the receiver merges the head over the body (protobuf parses a
      concatenation of encodings as their merge, so the message is the one `body + head` would
      give). The shared body is published as it is: joining it to each caller's part cost a
      copy of it per caller (~0.4 ms per MiB).
    * The last `attached` bytes of `body` (after the protobuf encoding; their number in the
      header `ATTACHED_HEADER`) are the message's attachment: the bytes its attached refs name
      (`fedhive.blobs.Attachment`), inline arrays that neither side copies into or out of
      protobuf (two copies of each per side), nor joins to it (`Parts`). A handler gets it as
      `Delivery.attachment`, a caller from `Bus.call_attached`.
    """

    message_type: type[Message]
    body: Body
    head: bytes = b""
    attached: int = 0

    @classmethod
    def attaching(cls, message_type: type[Message], proto: bytes,
                  attachment: Sequence[bytes | memoryview], head: bytes = b"") -> Encoded:
        """`proto` (a protobuf encoding) followed by the buffers of `attachment`, unjoined."""
        if not attachment:
            return cls(message_type, proto, head)
        body = Parts((proto, *attachment))
        return cls(message_type, body, head, len(body) - len(proto))

    def decode(self) -> Message:
        """The message a receiver gets (its attachment left out)."""
        return merged(self.message_type, self._proto(), self.head, queue="(encoded message)")

    def _proto(self) -> bytes:
        if isinstance(self.body, Parts):
            return bytes(self.body.pieces[0])  # `attaching` puts the encoding first
        return self.body[:len(self.body) - self.attached]


def encode(message: Message | Encoded) -> tuple[Body, Message | type[Message], dict[str, Any]]:
    """The body of `message`, what names its type (the AMQP `type` property) and the headers
    it adds (an `Encoded` message's head, the length of its attachment)."""
    if not isinstance(message, Encoded):
        return message.SerializeToString(), message, {}
    body, head = message.body, message.head
    headers: dict[str, Any] = {ATTACHED_HEADER: message.attached} if message.attached else {}
    if len(head) > HEAD_MAX:  # into the body, before the attachment (large props only)
        if isinstance(body, Parts):
            body = Parts((body.pieces[0], head, *body.pieces[1:]))
        else:
            view, end = memoryview(body), len(body) - message.attached
            body = b"".join((view[:end], head, view[end:]))
    elif head:
        headers[HEAD_HEADER] = head
    return body, message.message_type, headers


def split(body: bytes, headers: Mapping[str, Any], *, queue: str) -> tuple[bytes, memoryview]:
    """A received body as (protobuf encoding, attachment): `ATTACHED_HEADER` says how many of
    its last bytes are the attachment."""
    size = headers.get(ATTACHED_HEADER)
    if size is None:
        return body, NO_ATTACHMENT
    if not isinstance(size, int) or not 0 <= size <= len(body):
        raise MalformedMessage(f"{ATTACHED_HEADER} {size!r} on {queue} is not a length within "
                               f"the body ({len(body)} bytes)", field=ATTACHED_HEADER)
    view = memoryview(body)
    return bytes(view[:len(body) - size]), view[len(body) - size:]


class TypeRegistry:
    """The protobuf classes one consumer accepts, keyed by full name."""

    def __init__(self, classes: Iterable[type[Message]] = ()) -> None:
        self._classes: dict[str, type[Message]] = {}
        for cls in classes:
            self.add(cls)

    def add(self, cls: type[Message]) -> None:
        self._classes[cls.DESCRIPTOR.full_name] = cls

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def names(self) -> list[str]:
        return sorted(self._classes)

    def decode(self, name: str | None, body: bytes, *, queue: str) -> Message:
        """Parse `body` as the registered type `name`; `MalformedMessage` names what is wrong."""
        if not name:
            raise MalformedMessage(f"message on {queue} has no type property", field="type")
        cls = self._classes.get(name)
        if cls is None:
            raise MalformedMessage(
                f"message type {name!r} is not accepted on {queue} "
                f"(accepts: {', '.join(self.names()) or 'nothing'})",
                field="type",
            )
        return parse(cls, body, queue=queue)


def parse(cls: type[M], body: bytes, *, queue: str) -> M:
    message = cls()
    try:
        message.ParseFromString(body)
    except DecodeError as err:
        raise MalformedMessage(
            f"body of a {cls.DESCRIPTOR.full_name} on {queue} does not parse: {err}",
            field="body",
        ) from None
    return message


def merged(cls: type[M], body: bytes, head: bytes, *, queue: str) -> M:
    """`body` parsed as `cls`, with `head` (an `Encoded` reply's own part) merged over it."""
    message = parse(cls, body, queue=queue)
    if head:
        try:
            message.MergeFromString(head)
        except DecodeError as err:
            raise MalformedMessage(f"{HEAD_HEADER} of a {cls.DESCRIPTOR.full_name} on {queue} "
                                   f"does not parse: {err}", field=HEAD_HEADER) from None
    return message


def error_message(err: FedhiveError) -> common_pb2.Error:
    """A typed error as the reply body of a failed RPC."""
    return common_pb2.Error(code=err.code, message=err.message, field=err.field or "")


def error_from_message(reply: common_pb2.Error) -> FedhiveError:
    """The client side of `error_message`: the same typed error, rebuilt from its code."""
    return from_code(reply.code, reply.message, reply.field or None)
