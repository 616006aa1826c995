"""Exchanges and queues, declared idempotently: every declaration can be repeated as is.

* `{ns}.cmd` (topic): commands and RPC requests; a command queue is bound with its own name as
  routing key, so a sender addresses a queue by name and a pattern (`{ns}.site.*`) can fan out.
* `{ns}.events` (topic): events; each subscriber binds its own queue to patterns.
* `{ns}.dlx` (direct): dead letters; each queue `q` has `q.dlq` bound with routing key `q`.
* `{ns}.replies` (topic): RPC replies to the services' exclusive reply queues (`{ns}.reply.*`,
  each bound by its own name). Sites answer the services this way: they may not publish to the
  default exchange, which routes to any queue by name (see `fedhive.brokerusers`).

A site's bus declares nothing: a site's broker user may configure nothing at all
(`fedhive.brokerusers`). Its publisher and RPC client check the exchanges passively, its
consumer checks its control queue passively (neither needs any permission) and binds nothing.
The provisioning of the site's user declares that queue with the arguments below and binds it
(`fedhive.brokerusers`); it has no dead-letter queue. A queue that is not there (the site not
provisioned) is a `ConfigError` naming it.

Every consuming queue is durable, with a delivery limit, so a message that keeps failing is
dead-lettered instead of looping. Queues are quorum queues (replicated; the broker counts
deliveries) unless declared `classic`: a job's task queue, whose requests carry model tensors,
is one, because a quorum queue writes every message to its Raft log (measured: 4-5x the broker
CPU of a classic queue per MiB) and replication buys it nothing: its only consumer, the server
job, holds the job's state in memory, and callers resend unanswered requests after a reconnect.
For a classic queue the consumer counts deliveries itself (`fedhive.bus.consumer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pika.exceptions

from fedhive.errors import ConfigError
from fedhive.names import Names

DEFAULT_DELIVERY_LIMIT = 5
QUORUM, CLASSIC = "quorum", "classic"


@dataclass(frozen=True)
class QueueSpec:
    """A consuming queue and where it is bound: enough to re-declare it after a reconnect."""

    name: str
    exchange: str
    binding_keys: tuple[str, ...]
    queue_type: str = QUORUM  # or CLASSIC
    dead_letters: bool = True  # a `.dlq` beside it; a site's queue drops what it refuses


EXCHANGES = (("cmd_exchange", "topic"), ("events_exchange", "topic"),
             ("dead_letter_exchange", "direct"), ("replies_exchange", "topic"))


class Topology:
    """`site=True`: a site's view (exchanges and queues checked passively, queues without dead
    letters)."""

    def __init__(self, names: Names, *, delivery_limit: int = DEFAULT_DELIVERY_LIMIT,
                 site: bool = False) -> None:
        if delivery_limit < 1:
            raise ValueError(f"delivery_limit must be at least 1, got {delivery_limit}")
        self.names = names
        self.delivery_limit = delivery_limit
        self.site = site

    def command_queue(self, queue: str, binding_keys: Sequence[str] = (), *,
                      queue_type: str = QUORUM) -> QueueSpec:
        """A queue on the command exchange, bound to its own name plus `binding_keys`."""
        if queue_type not in (QUORUM, CLASSIC):
            raise ValueError(f"queue_type must be {QUORUM!r} or {CLASSIC!r}, not {queue_type!r}")
        return QueueSpec(queue, self.names.cmd_exchange, (queue, *binding_keys), queue_type,
                         dead_letters=not self.site)

    def events_queue(self, consumer: str, patterns: Sequence[str]) -> QueueSpec:
        if not patterns:
            raise ValueError(f"events queue for {consumer!r} needs at least one pattern")
        return QueueSpec(self.names.events_queue(consumer), self.names.events_exchange,
                         tuple(patterns))

    def exchanges(self) -> list[tuple[str, str]]:
        """(name, type) of every exchange of the namespace."""
        return [(getattr(self.names, attribute), kind) for attribute, kind in EXCHANGES]

    def declare_exchanges(self, channel: Any) -> None:
        for exchange, kind in self.exchanges():
            if self.site:  # fails (404) until the provisioning or the services declared it
                channel.exchange_declare(exchange=exchange, passive=True)
            else:
                channel.exchange_declare(exchange=exchange, exchange_type=kind, durable=True)

    def queue_arguments(self, spec: QueueSpec) -> dict[str, Any]:
        """What `spec` is declared with (by the provisioning, for a site's queue)."""
        arguments: dict[str, Any] = {"x-queue-type": spec.queue_type}
        if spec.dead_letters:
            arguments["x-dead-letter-exchange"] = self.names.dead_letter_exchange
            arguments["x-dead-letter-routing-key"] = spec.name
        if spec.queue_type == QUORUM:
            arguments["x-delivery-limit"] = self.delivery_limit
        return arguments

    def declare_queue(self, channel: Any, spec: QueueSpec) -> None:
        """The exchanges, the queue with its dead-letter queue, and its bindings; at a site, a
        check that the queue is there."""
        if self.site:
            self._check_queue(channel, spec.name)
            return
        self.declare_exchanges(channel)
        if spec.dead_letters:
            dlq = Names.dead_letter_queue(spec.name)
            channel.queue_declare(queue=dlq, durable=True, arguments={"x-queue-type": "quorum"})
            channel.queue_bind(queue=dlq, exchange=self.names.dead_letter_exchange,
                               routing_key=spec.name)
        channel.queue_declare(queue=spec.name, durable=True, arguments=self.queue_arguments(spec))
        *unconfirmed, last = spec.binding_keys
        for key in unconfirmed:  # no-wait binds (pika's channel under the blocking one), in order
            channel._impl.queue_bind(queue=spec.name, exchange=spec.exchange, routing_key=key)
        # the last one's reply confirms them all: a failed bind closes the channel before it
        channel.queue_bind(queue=spec.name, exchange=spec.exchange, routing_key=last)

    def _check_queue(self, channel: Any, queue: str) -> None:
        try:
            channel.queue_declare(queue=queue, passive=True)  # needs no permission
        except pika.exceptions.ChannelClosedByBroker as err:
            if err.reply_code != 404:
                raise
            site = self.names.site_of_queue(queue) or "SITE"
            raise ConfigError(
                f"queue {queue!r} does not exist on the broker (a site declares none): provision "
                f"site {site!r} first, e.g. `python deploy/broker_users.py --namespace "
                f"{self.names.ns} create {site} --credentials FILE` creates its broker user and "
                "its queue", field=queue) from None
