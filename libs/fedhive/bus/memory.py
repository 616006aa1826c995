"""`MemoryBus`: the bus port inside one process, for `fedhive simulate` and fast tests.

`MemoryBroker` (`fedhive.bus.memory_broker`) stands in for RabbitMQ, with its topic
matching, dead letters, delivery limits and verified `user_id`. Messages travel encoded exactly
as `RabbitBus` sends them (`properties`, the serialized body), and consumers decide with the
same functions (`fedhive.bus.delivery.admit` and `handle`), so handlers get fresh objects, and
type, sender and reply-address checks, typed errors, redelivery and dead letters behave as they
do on the broker. What differs, on purpose:
* no connections, so nothing to lose or reconnect; `prefetch` and `quick` are not used: each
  of a consumer's `concurrency` threads takes a message when it is free and handles it;
* the broker counts failed deliveries on every queue (RabbitMQ's quorum queues do; on a
  classic queue `RabbitBus`'s consumer counts) and dead-letters a message past the limit;
* a `Pending` reply is sent whenever it completes (nothing is left unacked to requeue);
* no provisioning step: a site's bus (its user is a site user of `names`) declares its control
  queue itself, as the provisioning would (no dead-letter queue).
It shares nothing between processes, so no service uses it.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import pika
import structlog
from google.protobuf.message import Message

from fedhive.bus.batch import REQUEUE, BatchHandler
from fedhive.bus.codec import Encoded, TypeRegistry, encode, joined
from fedhive.bus.consumer import REDELIVERY
from fedhive.bus.delivery import (
    DIRECT_REPLY_TO,
    Admission,
    Delivery,
    Handler,
    Quick,
    admit,
    handle,
)
from fedhive.bus.memory_broker import MemoryBroker, Queued
from fedhive.bus.publisher import properties
from fedhive.bus.rpc import Attached, Calls, Reply, answerers, decode_reply, reply_of, unanswered
from fedhive.bus.senders import Senders
from fedhive.bus.topology import CLASSIC, DEFAULT_DELIVERY_LIMIT, QUORUM, QueueSpec, Topology
from fedhive.errors import FedhiveError, Unavailable, Unroutable
from fedhive.names import Names
from fedhive.retry import Backoff

log = structlog.get_logger()

M = TypeVar("M", bound=Message)
_POLL = 0.1  # seconds a consumer waits for a message before it looks at its stop flag again


@dataclass(frozen=True)
class _Method:
    """What `Delivery.from_amqp` reads of pika's delivery method."""

    routing_key: str
    redelivered: bool


class MemoryBus(Calls):
    """The bus port on a `MemoryBroker`, as broker user `user` in the namespace of `names`."""

    def __init__(
        self,
        broker: MemoryBroker,
        user: str,
        names: Names,
        *,
        delivery_limit: int = DEFAULT_DELIVERY_LIMIT,
        redelivery: Backoff = REDELIVERY,
    ) -> None:
        self.user = user
        self.names = names
        self.topology = Topology(names, delivery_limit=delivery_limit,
                                 site=names.site_of_user(user) is not None)
        self._broker = broker
        self._redelivery = redelivery
        for exchange, kind in self.topology.exchanges():
            broker.declare_exchange(exchange, kind)
        self._rpc = _RpcClient(broker, user, self.topology)
        self._consumers: list[_Consumer | _BatchConsumer] = []
        self._lock = threading.Lock()
        self._closed = False

    def declare_queue(self, queue: str, binding_keys: Sequence[str] = ()) -> None:
        self._declare(self.topology.command_queue(queue, binding_keys))

    def delete_queue(self, queue: str) -> None:
        for name in (queue, Names.dead_letter_queue(queue)):
            self._broker.delete_queue(name)

    def send(self, queue: str, message: Message, *, message_id: str | None = None) -> str:
        exchange = self.names.cmd_exchange
        props = properties(message, message_id=message_id)
        if not self._publish(exchange, queue, message, props):
            raise Unroutable(
                f"no queue bound on exchange {exchange!r} for routing key {queue!r}", field=queue)
        return str(props.message_id)

    def publish_event(
        self, routing_key: str, message: Message, *, message_id: str | None = None
    ) -> str:
        props = properties(message, message_id=message_id)
        self._publish(self.names.events_exchange, routing_key, message, props)  # none: dropped
        return str(props.message_id)

    def serve(
        self,
        queue: str,
        handler: Handler,
        accepts: Iterable[type[Message]],
        *,
        binding_keys: Sequence[str] = (),
        senders: Senders | None = None,
        prefetch: int = 1,
        concurrency: int = 1,
        replicated: bool = True,
        quick: Quick | None = None,
    ) -> _Consumer:
        spec = self.topology.command_queue(queue, binding_keys,
                                           queue_type=QUORUM if replicated else CLASSIC)
        return self._start(_Consumer(self, spec, handler, TypeRegistry(accepts),
                                     senders or Senders.only(self.user), concurrency))

    def subscribe(
        self,
        consumer: str,
        patterns: Sequence[str],
        handler: Handler,
        accepts: Iterable[type[Message]],
        *,
        senders: Senders | None = None,
        prefetch: int = 1,
        concurrency: int = 1,
    ) -> _Consumer:
        spec = self.topology.events_queue(consumer, patterns)
        return self._start(_Consumer(self, spec, handler, TypeRegistry(accepts),
                                     senders or Senders.only(self.user), concurrency))

    def subscribe_batches(
        self,
        consumer: str,
        patterns: Sequence[str],
        handle_batch: BatchHandler,
        accepts: Iterable[type[Message]],
        *,
        senders: Senders | None = None,
        max_batch: int = 500,
        max_wait_s: float = 0.1,
    ) -> _BatchConsumer:
        spec = self.topology.events_queue(consumer, patterns)
        return self._start(_BatchConsumer(self, spec, handle_batch, TypeRegistry(accepts),
                                          senders or Senders.only(self.user),
                                          max_batch, max_wait_s))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            consumers, self._consumers = self._consumers, []
        for consumer in consumers:
            consumer.stop()
        self._rpc.close()

    # for this module's consumers ------------------------------------------------------------
    def _declare(self, spec: QueueSpec) -> None:
        """As `Topology.declare_queue`, with the limit on every queue (the broker counts)."""
        if spec.dead_letters:
            dlq = Names.dead_letter_queue(spec.name)
            self._broker.declare_queue(dlq, {})
            self._broker.bind(dlq, self.names.dead_letter_exchange, spec.name)
        arguments = {**self.topology.queue_arguments(spec),
                     "x-delivery-limit": self.topology.delivery_limit}
        self._broker.declare_queue(spec.name, arguments)
        for key in spec.binding_keys:
            self._broker.bind(spec.name, spec.exchange, key)

    def _publish(self, exchange: str, routing_key: str, message: Message,
                 props: pika.BasicProperties) -> bool:
        if self._closed:
            raise Unavailable(f"the bus of {self.user} is closed", field=routing_key)
        return self._broker.publish(self.user, exchange, routing_key,
                                    message.SerializeToString(), props)

    def _reply(self, delivery: Delivery, reply: Message | Encoded) -> None:
        body, kind, headers = encode(reply)
        self._broker.reply(self.user, delivery.reply_to or "", joined(body),
                           properties(kind, correlation_id=delivery.correlation_id,
                                      headers=headers))

    def _admit(self, queue: str, message: Queued, senders: Senders,
               accepts: TypeRegistry) -> Admission:
        """Check a taken message as `Consumer` does; one refused is settled here."""
        delivery = Delivery.from_amqp(queue, _Method(message.routing_key, message.redelivered),
                                      message.props)
        admission = admit(delivery, message.body, topology=self.topology, senders=senders,
                          accepts=accepts, log=log.bind(queue=queue))
        if admission.message is None:
            if admission.reply is not None:
                self._reply(delivery, admission.reply)
            if admission.dead_letter:
                self._broker.dead_letter(queue, message)
        return admission

    def _start(self, consumer: _C) -> _C:
        with self._lock:
            if self._closed:
                raise Unavailable(f"the bus of {self.user} is closed", field=consumer.name)
            self._consumers.append(consumer)
        consumer.start()
        return consumer


class _Consumer:
    """`serve`/`subscribe`: `concurrency` threads, each taking, handling and settling one
    message at a time."""

    def __init__(self, bus: MemoryBus, spec: QueueSpec, handler: Handler,
                 accepts: TypeRegistry, senders: Senders, concurrency: int) -> None:
        self.name = spec.name
        self._bus = bus
        self._spec = spec
        self._handler = handler
        self._accepts = accepts
        self._senders = senders
        self._stopping = threading.Event()
        self._consuming_since: float | None = None
        self._log = log.bind(queue=spec.name)
        self._threads = [threading.Thread(target=self._work, name=f"bus-memory-{spec.name}-{i}")
                         for i in range(max(concurrency, 1))]

    @property
    def queue(self) -> str:
        return self.name

    @property
    def consuming(self) -> bool:
        return self._consuming_since is not None

    @property
    def consuming_since(self) -> float | None:
        return self._consuming_since

    def start(self) -> None:
        self._bus._declare(self._spec)
        self._consuming_since = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop taking messages, let the running handlers finish and settle."""
        self._stopping.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        self._consuming_since = None

    def _work(self) -> None:
        broker = self._bus._broker
        while not self._stopping.is_set():
            try:
                message = broker.take(self.name, _POLL)
            except LookupError:  # its queue was deleted: declared again, as RabbitBus's is
                self._bus._declare(self._spec)
                continue
            if message is None:
                continue
            admission = self._bus._admit(self.name, message, self._senders, self._accepts)
            if admission.message is None:
                continue
            delivery = admission.delivery  # with the message's attachment
            outcome = handle(self._handler, admission.message, delivery, self._log)
            if outcome.pending is not None:
                outcome.pending.bind(partial(self._bus._reply, delivery))
            if outcome.reply is not None and delivery.reply_to:
                self._bus._reply(delivery, outcome.reply)
            if outcome.retry:
                self._stopping.wait(self._bus._redelivery.delay(delivery.delivery_count + 1))
                broker.requeue(self.name, message)
            elif outcome.dead_letter:
                broker.dead_letter(self.name, message)


class _BatchConsumer:
    """`subscribe_batches`: one thread gathering up to `max_batch` messages for at most
    `max_wait_s`, handling them at once; a batch whose handler raises is requeued whole."""

    def __init__(self, bus: MemoryBus, spec: QueueSpec, handle_batch: BatchHandler,
                 accepts: TypeRegistry, senders: Senders, max_batch: int,
                 max_wait_s: float) -> None:
        self.name = spec.name
        self._bus = bus
        self._spec = spec
        self._handle_batch = handle_batch
        self._accepts = accepts
        self._senders = senders
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._failures = 0
        self._stopping = threading.Event()
        self._consuming_since: float | None = None
        self._log = log.bind(queue=spec.name)
        self._thread = threading.Thread(target=self._run, name=f"bus-memory-batch-{spec.name}")

    @property
    def queue(self) -> str:
        return self.name

    @property
    def consuming(self) -> bool:
        return self._consuming_since is not None

    @property
    def consuming_since(self) -> float | None:
        return self._consuming_since

    def start(self) -> None:
        self._bus._declare(self._spec)
        self._consuming_since = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop taking messages, handle and settle the batch in hand."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._consuming_since = None

    def _run(self) -> None:
        batch: list[tuple[Queued, Message, Delivery]] = []
        deadline = 0.0  # when the batch in hand is due (set by its first message)
        while True:
            stopping = self._stopping.is_set()
            if batch and (stopping or len(batch) >= self._max_batch
                          or time.monotonic() >= deadline):
                self._settle(batch)
                batch = []
            if stopping:
                return
            wait = min(_POLL, max(0.0, deadline - time.monotonic())) if batch else _POLL
            try:
                message = self._bus._broker.take(self.name, wait)
            except LookupError:  # its queue was deleted: declared again, as RabbitBus's is
                self._bus._declare(self._spec)
                continue
            if message is None:
                continue
            admission = self._bus._admit(self.name, message, self._senders, self._accepts)
            if admission.message is not None:
                if not batch:
                    deadline = time.monotonic() + self._max_wait_s
                batch.append((message, admission.message, admission.delivery))

    def _settle(self, batch: list[tuple[Queued, Message, Delivery]]) -> None:
        try:
            self._handle_batch([(decoded, delivery) for _, decoded, delivery in batch])
        except Exception as err:  # transient by definition: requeue, the broker limits retries
            self._failures += 1
            wait = REQUEUE.delay(self._failures)
            self._log.warning("bus.batch_failed", error=repr(err), messages=len(batch),
                              wait=round(wait, 2))
            self._stopping.wait(wait)
            for message, _, _ in reversed(batch):  # each back to the head: in their order
                self._bus._broker.requeue(self.name, message)
        else:
            self._failures = 0


_C = TypeVar("_C", _Consumer, _BatchConsumer)


class _RpcClient:
    """Requests to command queues, replies filed by correlation id for their callers. The
    reply address: a direct reply-to name for a site's bus, else a services reply queue name,
    as `fedhive.bus.rpc` uses, so consumers check it the same way."""

    def __init__(self, broker: MemoryBroker, user: str, topology: Topology) -> None:
        self._broker = broker
        self._user = user
        self._topology = topology
        tag = uuid.uuid4().hex
        self._reply_to = (f"{DIRECT_REPLY_TO}.{tag}" if topology.site
                          else topology.names.reply_queue(tag))
        self._arrived = threading.Condition()  # guards the three below
        self._outstanding: dict[str, tuple[str, frozenset[str]]] = {}  # id -> target, answerers
        self._replies: dict[str, Reply] = {}  # correlation id -> the reply
        self._closed = False
        broker.listen(self._reply_to, self._on_reply)

    def call_many(
        self, requests: Mapping[str, Message | Encoded], reply_type: type[M], *, timeout: float
    ) -> dict[str, Attached[M] | FedhiveError]:
        deadline = time.monotonic() + timeout
        results: dict[str, Attached[M] | FedhiveError] = {}
        pending: dict[str, str] = {}  # correlation id -> target
        exchange = self._topology.names.cmd_exchange
        try:
            for target, message in requests.items():
                correlation_id = uuid.uuid4().hex
                body, kind, headers = encode(message)
                props = properties(
                    kind, reply_to=self._reply_to, correlation_id=correlation_id,
                    expiration_ms=max(1, math.ceil(timeout * 1000)), headers=headers,
                    persistent=False)
                with self._arrived:
                    if self._closed:
                        results[target] = unanswered(target, timeout, closed=True)
                        continue
                    self._outstanding[correlation_id] = (
                        target, answerers(self._topology, self._user, target))
                pending[correlation_id] = target
                if not self._broker.publish(self._user, exchange, target, joined(body), props):
                    del pending[correlation_id]
                    results[target] = Unroutable(
                        f"no queue bound on exchange {exchange!r} for {target!r}", field=target)
            with self._arrived:
                while True:
                    for correlation_id in [c for c in pending if c in self._replies]:
                        target = pending.pop(correlation_id)
                        results[target] = decode_reply(
                            target, self._replies.pop(correlation_id), reply_type)
                    left = deadline - time.monotonic()
                    if not pending or left <= 0 or self._closed:
                        break
                    self._arrived.wait(left)
        finally:
            with self._arrived:
                for correlation_id in pending:
                    self._outstanding.pop(correlation_id, None)
                    self._replies.pop(correlation_id, None)
        for target in pending.values():
            results[target] = unanswered(target, timeout, closed=self._closed)
        return results

    def close(self) -> None:
        self._broker.unlisten(self._reply_to)
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def _on_reply(self, props: pika.BasicProperties, body: bytes) -> None:
        with self._arrived:
            request = self._outstanding.get(props.correlation_id or "")
            if request is None:
                return  # the caller gave up already
            target, allowed = request
            if allowed and props.user_id not in allowed:
                log.warning("bus.reply_refused", security=True, sender=props.user_id,
                            target=target, accepted=sorted(allowed))
                return
            del self._outstanding[props.correlation_id]
            self._replies[props.correlation_id] = reply_of(props, body)
            self._arrived.notify_all()
