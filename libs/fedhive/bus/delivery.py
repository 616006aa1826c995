"""A delivery and what becomes of it, whatever the transport: the checks before its handler
(`admit`), the handler's result as an outcome (`handle`), and the types a handler deals with.
RabbitMQ's consumer (`fedhive.bus.consumer`) and the in-memory bus (`fedhive.bus.memory`)
decide with these same functions, then settle each message on their transport:

* returned normally: reply (for an RPC request) and ack;
* raised a `FedhiveError` (a domain error, it will never succeed): an RPC request gets a
  `fedhive.v1.Error` reply and is acked (its caller decides whether to retry); a one-way
  command is dead-lettered, unless the error is `Unavailable` (a store or the broker away for a
  moment), which is retried as below;
* raised anything else (transient): nack with requeue after a short backoff; after N failed
  deliveries it is dead-lettered (a quorum queue's delivery limit; on a classic queue, which
  counts nothing, the consumer counts by message id and rejects it itself);
* malformed (body does not parse, type missing or not accepted; a `reply_to` that is neither
  a direct reply-to nor a services reply queue): dead-lettered at once with its raw bytes,
  logged with a one-line reason;
* from a sender the queue does not accept (`Senders`: the broker-verified `user_id`, never a
  field of the body): refused before it is decoded, logged as a security event
  (`bus.sender_refused`), answered with PERMISSION_DENIED when it is an RPC request, and
  dropped (a dead-letter queue would only let the sender fill it).

A message is acked only after its handler returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.message import Message

from fedhive.bus.codec import NO_ATTACHMENT, Encoded, TypeRegistry, error_message, split
from fedhive.bus.publisher import DEADLINE_HEADER
from fedhive.bus.senders import Senders
from fedhive.bus.topology import Topology
from fedhive.errors import FedhiveError, MalformedMessage, PermissionDenied, Unavailable
from fedhive.proto.v1 import common_pb2

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"


@dataclass(frozen=True)
class Delivery:
    """What a handler may want to know about the message besides its body."""

    queue: str
    message_id: str | None
    type_name: str
    routing_key: str
    redelivered: bool
    delivery_count: int  # earlier unsuccessful deliveries (x-delivery-count, or the consumer's)
    user_id: str | None  # verified by RabbitMQ when present
    reply_to: str | None
    correlation_id: str | None
    timestamp: int | None
    headers: Mapping[str, Any] = field(default_factory=dict)
    attachment: memoryview = NO_ATTACHMENT  # an `Encoded` request's (`fedhive.bus.codec`)

    @classmethod
    def from_amqp(cls, queue: str, method: Any, props: Any) -> Delivery:
        """From pika's delivery method and message properties."""
        headers = props.headers or {}
        return cls(
            queue=queue,
            message_id=props.message_id,
            type_name=props.type or "",
            routing_key=method.routing_key,
            redelivered=bool(method.redelivered),
            delivery_count=int(headers.get("x-delivery-count", 0)),
            user_id=props.user_id,
            reply_to=props.reply_to,
            correlation_id=props.correlation_id,
            timestamp=props.timestamp,
            headers=headers,
        )


class Pending:
    """An RPC reply that comes later: the handler returns a `Pending` at once (its thread is
    free for the next message) and `complete`s it from any thread once the answer is known, as
    a long poll does when work appears. The request stays unacked until then (so it counts
    against the consumer's prefetch); one whose consumer stops or loses its connection first
    goes back to its queue, and completing it after that does nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reply: Message | Encoded | None = None
        self._sink: Callable[[Message | Encoded], None] | None = None

    def complete(self, reply: Message | Encoded) -> None:
        """Give the reply (only the first one given counts)."""
        with self._lock:
            if self._reply is not None:
                return
            self._reply = reply
            sink = self._sink
        if sink is not None:
            sink(reply)

    def bind(self, sink: Callable[[Message | Encoded], None]) -> None:
        """The transport's: where the reply goes, at once when it was given already."""
        with self._lock:
            self._sink = sink
            reply = self._reply
        if reply is not None:
            sink(reply)


Handler = Callable[[Message, Delivery], Message | Encoded | Pending | None]
Quick = Callable[[Message], bool]  # may run on a transport's I/O thread (`Bus.serve`)


@dataclass(frozen=True)
class Outcome:
    """What the handler's result means for its message (settled by the transport)."""

    reply: Message | Encoded | None = None
    dead_letter: bool = False
    retry: bool = False
    pending: Pending | None = None  # settled when it completes


@dataclass(frozen=True)
class Admission:
    """A delivery checked before its handler: `message` to hand to it with `delivery` (which
    holds the message's attachment), or else settled at once: `reply` sent if there is one,
    then dead-lettered or dropped (acked)."""

    delivery: Delivery
    message: Message | None = None
    reply: common_pb2.Error | None = None
    dead_letter: bool = False


def admit(
    delivery: Delivery, body: bytes, *, topology: Topology, senders: Senders,
    accepts: TypeRegistry, log: Any,
) -> Admission:
    """The checks of the module docstring: sender, reply address, deadline, then type and
    body."""
    if not senders.accepts(delivery.user_id):
        log.warning("bus.sender_refused", security=True, sender=delivery.user_id,
                    accepted=senders.describe(), type=delivery.type_name,
                    message_id=delivery.message_id, routing_key=delivery.routing_key)
        if not (delivery.reply_to and routable(delivery, topology)):
            return Admission(delivery)
        return Admission(delivery, reply=error_message(PermissionDenied(
            f"{delivery.queue} does not accept messages from broker user "
            f"{delivery.user_id or '(none: unsigned)'!r}", field="user_id")))
    if delivery.reply_to and not routable(delivery, topology):
        log.warning("bus.dead_letter_malformed", message_id=delivery.message_id,
                    reason=f"reply_to {delivery.reply_to[:100]!r} is not a reply "
                           "address of the sender", sender=delivery.user_id)
        return Admission(delivery, dead_letter=True)
    deadline = delivery.headers.get(DEADLINE_HEADER)
    if deadline is not None and time.time() * 1000 > deadline:
        log.info("bus.expired_request_dropped", message_id=delivery.message_id,
                 late_ms=int(time.time() * 1000 - deadline))
        return Admission(delivery)  # its caller has given up: serving it would act too late
    try:
        proto, attachment = split(body, delivery.headers, queue=delivery.queue)
        message = accepts.decode(delivery.type_name, proto, queue=delivery.queue)
    except MalformedMessage as err:
        log.warning("bus.dead_letter_malformed", message_id=delivery.message_id,
                    reason=str(err))
        return Admission(delivery, dead_letter=True)
    if attachment:
        delivery = replace(delivery, attachment=attachment)
    return Admission(delivery, message=message)


def routable(delivery: Delivery, topology: Topology) -> bool:
    """A direct reply-to (unless this is a site's consumer: a site may not publish to the
    default exchange), or a services reply queue when a non-site user asks: a site cannot
    have an answer published into the services' reply queues."""
    reply_to = delivery.reply_to or ""
    if reply_to.startswith(DIRECT_REPLY_TO):
        return not topology.site
    return (reply_to.startswith(topology.names.reply_queue(""))
            and topology.names.site_of_user(delivery.user_id) is None)


def handle(handler: Handler, message: Message, delivery: Delivery, log: Any) -> Outcome:
    """Run `handler` on one message (on a handler thread, or a `quick` one on the transport's
    I/O thread) and say what becomes of it."""
    bound = log.bind(message_id=delivery.message_id, type=delivery.type_name)
    try:
        reply = handler(message, delivery)
    except FedhiveError as err:
        if delivery.reply_to:
            bound.info("bus.rpc_error_reply", code=err.code, error=str(err))
            return Outcome(reply=error_message(err))
        if isinstance(err, Unavailable):  # Redis, S3 or the broker away: try again later
            bound.warning("bus.handler_failed", code=err.code, error=str(err),
                          delivery_count=delivery.delivery_count)
            return Outcome(retry=True)
        bound.warning("bus.dead_letter_failed_command", code=err.code, error=str(err))
        return Outcome(dead_letter=True)
    except Exception as err:  # transient by definition; the broker limits retries
        bound.warning("bus.handler_failed", error=repr(err),
                      delivery_count=delivery.delivery_count, exc_info=True)
        return Outcome(retry=True)
    if isinstance(reply, Pending):
        if delivery.reply_to:
            return Outcome(pending=reply)
        reply.bind(lambda _: None)  # a command has no one to answer: settled now
        return Outcome()
    if delivery.reply_to:
        return Outcome(reply=reply if reply is not None else common_pb2.Ack())
    return Outcome()
