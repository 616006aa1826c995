"""A batch consumer for high-rate events: one thread, one connection, one ack per batch.

`fedhive.bus` consumers settle each message on its own (a handler thread per message, one ack
frame per message); measured on this machine that alone costs ~0.9 ms of CPU per message, most
of it the per-message ack's loopback `send` and the thread hand-offs, i.e. ~18 % of a core for
1,000 sites beating every 5 s before any work is done. Heartbeats need neither: this consumer
decodes deliveries on its connection thread, gathers them for up to `max_wait_s` (or
`max_batch` messages), calls `handle_batch` once on that same thread and settles the whole
batch with one `basic_ack(multiple=True)`. Between polls it sleeps `poll_s` (unless a full
batch is waiting), so a steady trickle wakes it once per poll rather than once per message.

Built by `RabbitBus.subscribe_batches` from the same parts as `Consumer` (connection
parameters, `connect` with the reconnect backoff, `Topology` declarations, `TypeRegistry`
decoding, `Delivery`), so queue, dead-letter queue and bindings are exactly those of
`Bus.subscribe`. Semantics:
* each delivery is admitted as `Consumer` admits one (`fedhive.bus.delivery.admit`): a
  sender the queue does not accept (`Senders`) is dropped with a security log line, a
  malformed message (no/unknown type, body that does not parse) is dead-lettered at once, an
  expired request dropped;
* `handle_batch` returning: the batch is acked (the handler drops what it refuses itself);
* `handle_batch` raising: the batch is requeued after a backoff; the quorum queue's delivery
  limit dead-letters messages that keep failing;
* a lost connection: reconnect with backoff; unacked messages are redelivered by the broker.
`handle_batch` runs on the I/O thread, so it must be quick (one Redis round trip here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pika
import pika.exceptions
import structlog
from google.protobuf.message import Message

from fedhive.bus.codec import TypeRegistry
from fedhive.bus.connection import RECONNECT, connect, user_name
from fedhive.bus.consumer import settle_refused
from fedhive.bus.delivery import Delivery, admit
from fedhive.bus.senders import Senders
from fedhive.bus.topology import QueueSpec, Topology
from fedhive.errors import ConfigError, Unavailable
from fedhive.retry import Backoff

log = structlog.get_logger()

Batch = list[tuple[Message, Delivery]]
BatchHandler = Callable[[Batch], None]
REQUEUE = Backoff(base=0.2, cap=5.0)


class BatchConsumer:
    def __init__(
        self,
        params: pika.URLParameters,
        topology: Topology,
        spec: QueueSpec,
        accepts: TypeRegistry,
        handle_batch: BatchHandler,
        senders: Senders,
        *,
        max_batch: int = 500,
        max_wait_s: float = 0.1,
        poll_s: float = 0.02,
        prefetch: int = 1000,
    ) -> None:
        self.spec = spec
        self._params = params
        self._user_id = user_name(params)
        self._topology = topology
        self._accepts = accepts
        self._handle_batch = handle_batch
        self._senders = senders
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._poll_s = poll_s
        self._prefetch = max(prefetch, max_batch)
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: ConfigError | None = None
        self._failures = 0
        self._consuming_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"batch-consumer-{spec.name}")
        self._log = log.bind(queue=spec.name)

    @property
    def queue(self) -> str:
        return self.spec.name

    @property
    def consuming(self) -> bool:
        """Connected and consuming (a consumer the broker cancels reconnects: `_consume`)."""
        return self._consuming_since is not None

    @property
    def consuming_since(self) -> float | None:
        """`time.monotonic()` when the current connection began consuming; None while
        (re)connecting: what it missed meanwhile is not known."""
        return self._consuming_since

    def start(self, timeout: float = 30.0) -> None:
        """Start consuming; returns once the queue is declared and consumed from."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise Unavailable(f"consumer of {self.spec.name} did not start within {timeout}s",
                              field=self.spec.name)
        if self._start_error is not None:  # as `Consumer.start`: only the operator can fix it
            self.stop()
            raise self._start_error

    def stop(self) -> None:
        """Stop consuming, handle and settle the batch in hand, close, join the thread."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                self._consume()
                return
            except Unavailable:
                return  # stopped while connecting
            except Exception as err:  # the consumer must outlive any failure
                if isinstance(err, ConfigError) and not self._ready.is_set():
                    self._start_error = err
                    self._ready.set()
                    return
                attempt = 1 if self._ready.is_set() else attempt + 1
                wait = RECONNECT.delay(attempt)
                self._log.warning("bus.consumer_reconnect", error=repr(err), wait=round(wait, 2))
                self._stopping.wait(wait)

    def _consume(self) -> None:
        connection = connect(self._params, RECONNECT, stop=self._stopping)
        batch: Batch = []
        tags: list[int] = []
        try:
            channel = connection.channel()
            self._topology.declare_queue(channel, self.spec)
            channel.basic_qos(prefetch_count=self._prefetch)
            tag = channel.basic_consume(self.spec.name, partial(self._on_message, batch, tags))
            self._consuming_since = time.monotonic()
            self._ready.set()
            self._log.info("bus.consuming", batch=self._max_batch)
            deadline = 0.0  # when the batch in hand must be settled (set by its first message)
            while not self._stopping.is_set():
                # Drain what the socket holds, then let deliveries gather: one wake-up per poll
                # instead of one per message (what costs most at a steady trickle).
                had = len(batch)
                connection.process_data_events(time_limit=0)
                if tag not in channel.consumer_tags:  # the broker cancelled it (queue deleted)
                    raise pika.exceptions.ConsumerCancelled(self.spec.name)
                if batch and not had:
                    deadline = time.monotonic() + self._max_wait_s
                if batch and (len(batch) >= self._max_batch or time.monotonic() >= deadline):
                    self._settle(channel, batch, tags)
                    continue
                self._stopping.wait(self._poll_s)
            if batch:
                self._settle(channel, batch, tags)
        finally:
            self._consuming_since = None
            if connection.is_open:
                connection.close()

    def _on_message(
        self, batch: Batch, tags: list[int], channel: Any, method: Any, props: Any, body: bytes
    ) -> None:
        delivery = Delivery.from_amqp(self.spec.name, method, props)
        admission = admit(delivery, body, topology=self._topology, senders=self._senders,
                          accepts=self._accepts, log=self._log)
        if admission.message is None:
            settle_refused(channel, method.delivery_tag, delivery, admission,
                           topology=self._topology, user_id=self._user_id)
            return
        batch.append((admission.message, admission.delivery))
        tags.append(method.delivery_tag)

    def _settle(self, channel: Any, batch: Batch, tags: list[int]) -> None:
        try:
            self._handle_batch(list(batch))
        except Exception as err:  # transient by definition: requeue, the broker limits retries
            self._failures += 1
            wait = REQUEUE.delay(self._failures)
            self._log.warning("bus.batch_failed", error=repr(err), messages=len(batch),
                              wait=round(wait, 2))
            self._stopping.wait(wait)
            for tag in tags:  # one by one: a rejected (malformed) tag may lie in between
                channel.basic_nack(tag, requeue=True)
        else:
            self._failures = 0
            channel.basic_ack(tags[-1], multiple=True)
        batch.clear()
        tags.clear()
