"""Publishing with publisher confirms: `publish` returns once the broker confirmed the message,
or raises. On a lost connection it reconnects (per the backoff) and publishes the same message
again, so nothing is lost silently; a duplicate is possible (at-least-once), which consumers
absorb by `message_id`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import pika
import pika.exceptions
import structlog
from google.protobuf.message import Message

from fedhive.bus.codec import CONTENT_TYPE, type_name
from fedhive.bus.connection import CONNECTION_LOST, GuardedConnection, user_name
from fedhive.bus.topology import Topology
from fedhive.errors import Unavailable, Unroutable
from fedhive.retry import Backoff

log = structlog.get_logger()

# How long a publish keeps trying to reach the broker before it raises `Unavailable`.
REPUBLISH = Backoff(base=0.1, cap=2.0, max_attempts=None, deadline=30.0)


DEADLINE_HEADER = "x-fedhive-deadline-ms"


def properties(
    message: Message | type[Message],
    *,
    message_id: str | None = None,
    user_id: str | None = None,
    reply_to: str | None = None,
    correlation_id: str | None = None,
    expiration_ms: int | None = None,
    headers: Mapping[str, Any] | None = None,
    persistent: bool = True,
) -> pika.BasicProperties:
    """The AMQP properties every fedhive message carries.

    A message with `expiration_ms` also carries its absolute deadline (`DEADLINE_HEADER`, epoch
    milliseconds): the broker's TTL starts only when the message is enqueued, so a consumer
    checks the deadline too and never serves a request its caller has given up on.
    """
    if expiration_ms is not None:
        deadline = {DEADLINE_HEADER: int(time.time() * 1000) + expiration_ms}
        headers = {**(headers or {}), **deadline}
    return pika.BasicProperties(
        content_type=CONTENT_TYPE,
        type=type_name(message),
        message_id=message_id or uuid.uuid4().hex,
        timestamp=int(time.time()),
        delivery_mode=pika.DeliveryMode.Persistent if persistent else pika.DeliveryMode.Transient,
        user_id=user_id,
        reply_to=reply_to,
        correlation_id=correlation_id,
        expiration=None if expiration_ms is None else str(expiration_ms),
        headers=dict(headers) if headers else None,
    )


class Publisher:
    """Confirmed publishing over one guarded connection; safe to share between threads.

    Every message carries the AMQP `user_id` of this connection's user, which RabbitMQ
    verifies, so a receiver can trust who sent it (`fedhive.bus.senders`).
    """

    def __init__(
        self,
        params: pika.URLParameters,
        topology: Topology,
        *,
        backoff: Backoff = REPUBLISH,
    ) -> None:
        self._topology = topology
        self._conn = GuardedConnection(params, self._setup, backoff=backoff)
        self._user_id = user_name(params)
        self._backoff = backoff

    def publish(
        self,
        exchange: str,
        routing_key: str,
        message: Message,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        mandatory: bool = True,
    ) -> str:
        """Publish and wait for the broker's confirm; returns the message id.

        Raises `Unroutable` when `mandatory` and no queue is bound for `routing_key` (or the
        exchange does not exist), `Unavailable` when the broker stays unreachable past the
        backoff deadline.
        """
        props = properties(message, message_id=message_id, user_id=self._user_id, headers=headers)
        self.publish_raw(exchange, routing_key, message.SerializeToString(), props, mandatory)
        return str(props.message_id)

    def publish_raw(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        props: pika.BasicProperties,
        mandatory: bool = True,
    ) -> None:
        delays = self._backoff.delays()
        while True:
            try:
                with self._conn.lock:
                    self._conn.channel().basic_publish(
                        exchange, routing_key, body, props, mandatory=mandatory
                    )
                return
            except pika.exceptions.UnroutableError:
                raise Unroutable(
                    f"no queue bound on exchange {exchange!r} for routing key {routing_key!r}",
                    field=routing_key,
                ) from None
            except pika.exceptions.ChannelClosedByBroker as err:
                with self._conn.lock:
                    self._conn.reset()
                if err.reply_code == 404:
                    raise Unroutable(
                        f"exchange {exchange!r} does not exist (routing key {routing_key!r})",
                        field=exchange,
                    ) from None
                raise Unavailable(
                    f"broker refused a publish to {exchange!r}/{routing_key!r}: {err.reply_text}",
                    field=routing_key,
                ) from None
            except (*CONNECTION_LOST, pika.exceptions.NackError) as err:
                with self._conn.lock:
                    self._conn.reset()
                wait = next(delays, None)
                if wait is None:
                    raise Unavailable(
                        f"publish to {exchange!r}/{routing_key!r} not confirmed: {err!r}",
                        field=routing_key,
                    ) from err
                log.info("bus.republish", exchange=exchange, routing_key=routing_key,
                         message_id=props.message_id, wait=round(wait, 2), error=repr(err))
                time.sleep(wait)

    def _setup(self, channel: Any) -> None:
        self._topology.declare_exchanges(channel)  # so a publish never meets a missing exchange
        channel.confirm_delivery()

    def close(self) -> None:
        self._conn.close()
