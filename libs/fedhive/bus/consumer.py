"""A consumer: one thread that owns one connection, and a small pool that runs the handler.

The connection thread only does AMQP: it decodes each delivery, hands the decoded message to the
pool, and keeps servicing the connection (heartbeats included) however long the handler runs.
When the handler returns, its outcome comes back through `add_callback_threadsafe` and the
connection thread replies/acks. A message the consumer's `quick` predicate picks (work that
takes a fraction of a millisecond and waits on nothing: a server job folding an inline result)
is handled on the connection thread itself: the two thread hand-offs cost more than the work
(bench/RESULTS.md, scale). What becomes of each message (reply, ack, retry, dead letter,
refusal) is decided by `fedhive.bus.delivery`, as the in-memory bus decides it.

Replies go back where `reply_to` says: a direct reply-to name through the default exchange (a
caller on a site's connection), a services reply queue (`Names.reply_queue`) through the
replies exchange (a site may not publish to the default exchange).

On a lost connection, or a consumer the broker cancelled (its queue deleted), the thread
reconnects with backoff, re-declares its queue and resumes; unacked messages are redelivered by
the broker. A `ConfigError` before it first consumed (a
site's control queue not provisioned: `fedhive.bus.topology`) ends `start()` with that error:
nothing but the operator can fix it. After that first start it is retried like any failure
(the site re-provisioned while it waits).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pika
import pika.exceptions
import structlog
from google.protobuf.message import Message

from fedhive.bus.codec import Encoded, TypeRegistry, encode
from fedhive.bus.connection import RECONNECT, call_threadsafe, connect, user_name, wake
from fedhive.bus.delivery import (
    DIRECT_REPLY_TO,
    Admission,
    Delivery,
    Handler,
    Outcome,
    Quick,
    admit,
    handle,
)
from fedhive.bus.publisher import properties
from fedhive.bus.senders import Senders
from fedhive.bus.topology import QUORUM, QueueSpec, Topology
from fedhive.errors import ConfigError, Unavailable
from fedhive.retry import Backoff

log = structlog.get_logger()

# Wait before requeueing a message whose handler failed transiently (attempt = deliveries so far).
REDELIVERY = Backoff(base=0.05, cap=2.0)
_COUNTED = 10_000  # message ids whose failed deliveries a classic queue's consumer remembers
# The connection thread returns from `process_data_events` on every delivery, reply to hand
# back, consumer cancelled by the broker and `stop()` (which wakes it); otherwise only this often.
# Idle consumers waking 5 times a second cost a 100-site light host ~500 GIL takes a second.
IDLE_WAKE_S = 2.0


def send_reply(channel: Any, delivery: Delivery, reply: Message | Encoded, *,
               topology: Topology, user_id: str | None) -> None:
    """Publish `reply` to `delivery`'s caller on a pika channel (see the module docstring)."""
    body, kind, headers = encode(reply)
    reply_to = delivery.reply_to or ""
    exchange = "" if reply_to.startswith(DIRECT_REPLY_TO) else topology.names.replies_exchange
    channel.basic_publish(exchange, reply_to, body, properties(
        kind, user_id=user_id, correlation_id=delivery.correlation_id, headers=headers))


def settle_refused(channel: Any, tag: int, delivery: Delivery, admission: Admission, *,
                   topology: Topology, user_id: str | None) -> None:
    """A delivery `admit` refused, settled on its pika channel at once: its reply sent if it
    has one, then dead-lettered or dropped."""
    if admission.reply is not None:
        send_reply(channel, delivery, admission.reply, topology=topology, user_id=user_id)
    if admission.dead_letter:
        channel.basic_reject(tag, requeue=False)
    else:
        channel.basic_ack(tag)


@dataclass
class _Session:
    """One connection's state; callbacks of an older session never touch a newer one."""

    connection: Any
    channel: Any
    unsettled: set[int] = field(default_factory=set)


class Consumer:
    """Consume `spec` with `handler`; `start()` once, `stop()` once. See the module docstring."""

    def __init__(
        self,
        params: pika.URLParameters,
        topology: Topology,
        spec: QueueSpec,
        handler: Handler,
        accepts: TypeRegistry,
        senders: Senders,
        *,
        prefetch: int = 1,
        concurrency: int = 1,
        quick: Quick | None = None,
        redelivery: Backoff = REDELIVERY,
    ) -> None:
        self.spec = spec
        self._params = params
        self._topology = topology
        self._handler = handler
        self._quick = quick
        self._accepts = accepts
        self._senders = senders
        self._prefetch = max(prefetch, concurrency)
        self._user_id = user_name(params)
        self._redelivery = redelivery
        # failed deliveries by message id, counted here when the broker does not (classic)
        self._failed: OrderedDict[str, int] | None = (
            None if spec.queue_type == QUORUM else OrderedDict())
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"bus-handler-{spec.name}")
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: ConfigError | None = None
        self._consumed = False  # whether the current connection got as far as consuming
        self._consuming_since: float | None = None
        self._live: tuple[_Session, str] | None = None  # (session, consumer tag) while consuming
        self._thread = threading.Thread(target=self._run, name=f"bus-consumer-{spec.name}")
        self._log = log.bind(queue=spec.name)

    def start(self, timeout: float = 30.0) -> None:
        """Start consuming; returns once the queue is declared and consumed from."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise Unavailable(f"consumer of {self.spec.name} did not start within {timeout}s",
                              field=self.spec.name)
        if self._start_error is not None:
            self.stop()
            raise self._start_error

    @property
    def queue(self) -> str:
        return self.spec.name

    @property
    def consuming(self) -> bool:
        """Whether new deliveries can arrive right now: connected, the channel open and the
        consumer still registered (false while reconnecting, and once the broker closed the
        channel or cancelled the consumer, e.g. because its queue was deleted)."""
        live = self._live
        return (live is not None and live[0].channel.is_open
                and live[1] in live[0].channel.consumer_tags)

    @property
    def consuming_since(self) -> float | None:
        """`time.monotonic()` when the current connection began consuming; None while
        (re)connecting: what it missed meanwhile is not known."""
        return self._consuming_since

    def stop(self) -> None:
        """Stop consuming, let running handlers finish and settle, close, join the threads."""
        self._stopping.set()
        live = self._live
        if live is not None:  # wake its connection thread, idle in `process_data_events`
            wake(live[0].connection)
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # connection thread -------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            self._consumed = False
            try:
                self._consume()
                return
            except Unavailable:
                return  # stopped while connecting
            except Exception as err:  # the consumer must outlive any failure
                if isinstance(err, ConfigError) and not self._ready.is_set():
                    self._start_error = err  # never consumed yet: start() raises it
                    self._ready.set()
                    return
                attempt = 1 if self._consumed else attempt + 1
                wait = RECONNECT.delay(attempt)
                self._log.warning("bus.consumer_reconnect", error=repr(err), wait=round(wait, 2))
                self._stopping.wait(wait)

    def _consume(self) -> None:
        connection = connect(self._params, RECONNECT, stop=self._stopping)
        try:
            channel = connection.channel()
            session = _Session(connection, channel)
            self._topology.declare_queue(channel, self.spec)
            channel.basic_qos(prefetch_count=self._prefetch)
            tag = channel.basic_consume(self.spec.name, partial(self._on_message, session))
            self._consumed = True
            self._consuming_since = time.monotonic()
            self._live = (session, tag)
            self._ready.set()
            self._log.info("bus.consuming")
            while not self._stopping.is_set():
                connection.process_data_events(time_limit=IDLE_WAKE_S)
                if tag not in channel.consumer_tags:  # the broker cancelled it (queue deleted)
                    raise pika.exceptions.ConsumerCancelled(self.spec.name)
            self._live = None
            channel.basic_cancel(tag)
            self._consuming_since = None
            while session.unsettled:  # handlers still running: let them finish and settle
                connection.process_data_events(time_limit=0.1)
        finally:
            self._consuming_since = None
            self._live = None
            if connection.is_open:
                connection.close()

    def _on_message(
        self, session: _Session, channel: Any, method: Any, props: Any, body: bytes
    ) -> None:
        delivery = Delivery.from_amqp(self.spec.name, method, props)
        if self._failed is not None:
            delivery = replace(delivery,
                               delivery_count=self._failed.get(delivery.message_id or "", 0))
        tag = method.delivery_tag
        admission = admit(delivery, body, topology=self._topology, senders=self._senders,
                          accepts=self._accepts, log=self._log)
        if admission.message is None:
            settle_refused(channel, tag, delivery, admission, topology=self._topology,
                           user_id=self._user_id)
            return
        session.unsettled.add(tag)
        delivery = admission.delivery  # with the message's attachment
        if self._quick is not None and self._quick(admission.message):
            self._settle(session, tag, delivery,
                         handle(self._handler, admission.message, delivery, self._log))
            return
        future = self._pool.submit(handle, self._handler, admission.message, delivery, self._log)
        future.add_done_callback(partial(self._hand_back, session, tag, delivery))

    def _reply(self, channel: Any, delivery: Delivery, reply: Message | Encoded) -> None:
        send_reply(channel, delivery, reply, topology=self._topology, user_id=self._user_id)

    def _hand_back(
        self, session: _Session, tag: int, delivery: Delivery, future: Future[Outcome]
    ) -> None:
        """Runs in the handler thread: pass the outcome to the connection thread."""
        failed = future.cancelled() or future.exception() is not None
        outcome = Outcome(retry=True) if failed else future.result()
        call_threadsafe(session.connection, partial(self._settle, session, tag, delivery, outcome))

    def _settle(self, session: _Session, tag: int, delivery: Delivery, outcome: Outcome) -> None:
        channel = session.channel
        if not channel.is_open:
            session.unsettled.discard(tag)
            return
        if outcome.pending is not None:  # not waited for by `stop`: requeued if it comes late
            session.unsettled.discard(tag)
            outcome.pending.bind(partial(self._hand_back_reply, session, tag, delivery))
            return
        if outcome.reply is not None and delivery.reply_to:
            self._reply(channel, delivery, outcome.reply)
        if outcome.retry and not self._gives_up(delivery):
            wait = self._redelivery.delay(delivery.delivery_count + 1)
            session.connection.call_later(wait, partial(self._requeue, session, tag))
            return
        if outcome.dead_letter or outcome.retry:
            channel.basic_reject(tag, requeue=False)
        else:
            channel.basic_ack(tag)
            if self._failed is not None:
                self._failed.pop(delivery.message_id or "", None)
        session.unsettled.discard(tag)

    def _hand_back_reply(self, session: _Session, tag: int, delivery: Delivery,
                         reply: Message | Encoded) -> None:
        """Runs where a `Pending` completes: reply and ack on the connection thread."""
        call_threadsafe(session.connection,
                        partial(self._settle_later, session, tag, delivery, reply))

    def _settle_later(self, session: _Session, tag: int, delivery: Delivery,
                      reply: Message | Encoded) -> None:
        if session.channel.is_open:
            self._reply(session.channel, delivery, reply)
            session.channel.basic_ack(tag)

    def _gives_up(self, delivery: Delivery) -> bool:
        """A classic queue's message failed its last allowed delivery (counted here, on the
        connection thread); a quorum queue's broker decides itself."""
        if self._failed is None:
            return False
        key = delivery.message_id or ""
        failures = self._failed.pop(key, 0) + 1
        if failures > self._topology.delivery_limit:
            self._log.warning("bus.dead_letter_delivery_limit", message_id=key,
                              deliveries=failures)
            return True
        self._failed[key] = failures
        while len(self._failed) > _COUNTED:
            self._failed.popitem(last=False)
        return False

    @staticmethod
    def _requeue(session: _Session, tag: int) -> None:
        session.unsettled.discard(tag)
        if session.channel.is_open:
            session.channel.basic_nack(tag, requeue=True)
