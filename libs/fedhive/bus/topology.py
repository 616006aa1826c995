"""Exchanges and queues, declared idempotently: every declaration can be repeated as is.

* `{ns}.cmd` (topic): commands and RPC requests; a command queue is bound with its own name as
  routing key, so a sender addresses a queue by name and a pattern (`{ns}.site.*`) can fan out.
* `{ns}.events` (topic): events; each subscriber binds its own queue to patterns.
* `{ns}.dlx` (direct): dead letters; each queue `q` has `q.dlq` bound with routing key `q`.

Every consuming queue is a durable quorum queue with a delivery limit, so a message that keeps
failing is dead-lettered by the broker instead of looping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedhive.names import Names

DEFAULT_DELIVERY_LIMIT = 5


@dataclass(frozen=True)
class QueueSpec:
    """A consuming queue and where it is bound: enough to re-declare it after a reconnect."""

    name: str
    exchange: str
    binding_keys: tuple[str, ...]


class Topology:
    def __init__(self, names: Names, *, delivery_limit: int = DEFAULT_DELIVERY_LIMIT) -> None:
        if delivery_limit < 1:
            raise ValueError(f"delivery_limit must be at least 1, got {delivery_limit}")
        self.names = names
        self.delivery_limit = delivery_limit

    def command_queue(self, queue: str, binding_keys: Sequence[str] = ()) -> QueueSpec:
        """A queue on the command exchange, bound to its own name plus `binding_keys`."""
        return QueueSpec(queue, self.names.cmd_exchange, (queue, *binding_keys))

    def events_queue(self, consumer: str, patterns: Sequence[str]) -> QueueSpec:
        if not patterns:
            raise ValueError(f"events queue for {consumer!r} needs at least one pattern")
        return QueueSpec(self.names.events_queue(consumer), self.names.events_exchange,
                         tuple(patterns))

    def declare_exchanges(self, channel: Any) -> None:
        for exchange, kind in (
            (self.names.cmd_exchange, "topic"),
            (self.names.events_exchange, "topic"),
            (self.names.dead_letter_exchange, "direct"),
        ):
            channel.exchange_declare(exchange=exchange, exchange_type=kind, durable=True)

    def declare_queue(self, channel: Any, spec: QueueSpec) -> None:
        """The exchanges, the queue with its dead-letter queue, and its bindings."""
        self.declare_exchanges(channel)
        dlq = Names.dead_letter_queue(spec.name)
        channel.queue_declare(queue=dlq, durable=True, arguments={"x-queue-type": "quorum"})
        channel.queue_bind(queue=dlq, exchange=self.names.dead_letter_exchange,
                           routing_key=spec.name)
        channel.queue_declare(
            queue=spec.name,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delivery-limit": self.delivery_limit,
                "x-dead-letter-exchange": self.names.dead_letter_exchange,
                "x-dead-letter-routing-key": spec.name,
            },
        )
        for key in spec.binding_keys:
            channel.queue_bind(queue=spec.name, exchange=spec.exchange, routing_key=key)
