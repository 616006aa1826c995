"""RPC over RabbitMQ: requests to a command queue, replies to the caller's reply address.

The reply address: on a services connection, an exclusive queue of this client
(`Names.reply_queue`, declared anew with each connection) bound to the replies exchange, where
sites, which may not publish to the default exchange, can answer; on a site's connection,
RabbitMQ's direct reply-to (only the services answer a site, through the default exchange),
which costs the task traffic's hot path no queue. A services client takes a reply only from
the broker user that may answer it (a site's control queue: that site, or the services; any
other queue: the services), so a site that learnt a reply queue's name cannot answer for
another; on a site's connection only the services can publish to direct reply-to at all.

Many threads may call at once. Requests and the reply consumer share one guarded connection;
one waiting caller at a time services it, filing every reply it receives under its correlation
id, so each caller finds its own; the others sleep until a reply is filed or it hands over. It
holds the connection until a reply comes (a caller that must send meanwhile wakes it:
`GuardedConnection.held`), not for short slices: 50 callers waiting, each waking 20 times a
second, took 130 ms of CPU a second (bench/RESULTS.md, scale). A request carries the caller's
timeout as its AMQP expiration and as an absolute deadline the consumer checks (hosts' clocks
must agree, as for presigned URLs), so it is never served late. If the connection drops, the
next caller to take the lock reconnects and sends all outstanding requests again on the new
channel (at-least-once; servers are idempotent by message_id).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pika
import pika.exceptions
import structlog
from google.protobuf.message import Message

from fedhive.bus.codec import (
    ERROR_TYPE,
    HEAD_HEADER,
    Body,
    Encoded,
    encode,
    error_from_message,
    merged,
    parse,
    split,
)
from fedhive.bus.connection import CONNECTION_LOST, GuardedConnection, user_name
from fedhive.bus.delivery import DIRECT_REPLY_TO
from fedhive.bus.publisher import REPUBLISH, properties
from fedhive.bus.topology import Topology
from fedhive.errors import FedhiveError, MalformedMessage, RpcTimeout, Unavailable, Unroutable
from fedhive.proto.v1 import common_pb2
from fedhive.retry import Backoff

log = structlog.get_logger()

# Longest a caller services the connection in one go: a safety net, since every reply, every
# caller that needs the connection and `close()` make it return at once.
SLICE = 2.0

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class _Request:
    target: str
    body: Body
    props: pika.BasicProperties
    answerers: frozenset[str]  # the broker users whose reply is taken; empty: anyone's


class RpcClient:
    def __init__(
        self,
        params: pika.URLParameters,
        topology: Topology,
        *,
        backoff: Backoff = REPUBLISH,
    ) -> None:
        self._topology = topology
        self._exchange = topology.names.cmd_exchange
        self._user_id = user_name(params)
        self._reply_to = DIRECT_REPLY_TO  # this channel's reply address; set by _setup
        self._backoff = backoff
        self._outstanding: dict[str, _Request] = {}  # by correlation id; guarded by the lock
        self._generation = 0  # bumped per new channel; guarded by the lock
        self._replies: dict[str, Reply | FedhiveError] = {}
        self._arrived = threading.Condition()  # guards _replies and _servicing
        self._servicing = False  # a caller is (about to be) servicing the connection
        self._conn = GuardedConnection(params, self._setup, backoff=backoff)

    def call_many(
        self, requests: Mapping[str, Message | Encoded], reply_type: type[M], *, timeout: float
    ) -> dict[str, Attached[M] | FedhiveError]:
        """Call several queues at once, waiting at most `timeout` in all.

        Returns, per target, its reply and the reply's attachment, or the error it ended with
        (`RpcTimeout` naming the queue and the timeout, `Unroutable`, the typed error the server
        replied with); never raises for one target.
        """
        deadline = time.monotonic() + timeout
        results: dict[str, Attached[M] | FedhiveError] = {}
        pending: dict[str, str] = {}  # correlation id -> target
        try:
            for target, message in requests.items():
                correlation_id = uuid.uuid4().hex
                # transient: a request lives no longer than its caller waits, and the caller
                # resends it on a new connection (a classic queue then keeps it off disk)
                body, kind, headers = encode(message)
                props = properties(
                    kind, user_id=self._user_id, correlation_id=correlation_id,
                    expiration_ms=max(1, math.ceil(timeout * 1000)), headers=headers,
                    persistent=False)
                request = _Request(target, body, props,
                                   answerers(self._topology, self._user_id, target))
                try:
                    self._send(correlation_id, request)
                except FedhiveError as err:
                    results[target] = err
                else:
                    pending[correlation_id] = target
            while pending and (left := deadline - time.monotonic()) > 0:
                if self._conn.closed:  # the process is shutting down: no reply will come
                    break
                self._wait(min(left, SLICE), lambda: any(c in self._replies for c in pending))
                with self._arrived:
                    arrived = [c for c in pending if c in self._replies]
                    for correlation_id in arrived:
                        target = pending.pop(correlation_id)
                        results[target] = decode_reply(
                            target, self._replies.pop(correlation_id), reply_type
                        )
        finally:
            if pending:
                with self._conn.held():
                    for correlation_id in pending:
                        self._outstanding.pop(correlation_id, None)
                with self._arrived:
                    for correlation_id in pending:
                        self._replies.pop(correlation_id, None)
        for target in pending.values():
            results[target] = unanswered(target, timeout, closed=self._conn.closed)
        return results

    def close(self) -> None:
        self._conn.close()

    # internals ----------------------------------------------------------------------------
    def _setup(self, channel: Any) -> None:
        """A new channel: consume replies, then resend what the old channel left unanswered."""
        self._topology.declare_exchanges(channel)
        channel.confirm_delivery()
        if self._topology.site:
            self._reply_to = DIRECT_REPLY_TO
        else:  # a fresh name: an exclusive queue of a dropped connection may linger a moment
            self._reply_to = self._topology.names.reply_queue(uuid.uuid4().hex)
            channel.queue_declare(self._reply_to, exclusive=True, auto_delete=True,
                                  arguments={"x-queue-type": "classic"})
            channel.queue_bind(self._reply_to, self._topology.names.replies_exchange,
                               routing_key=self._reply_to)
        channel.basic_consume(self._reply_to, self._on_reply, auto_ack=True)
        self._generation += 1
        for correlation_id, request in list(self._outstanding.items()):
            self._publish(channel, correlation_id, request)

    def _send(self, correlation_id: str, request: _Request) -> None:
        delays = self._backoff.delays()
        while True:
            with self._conn.held():
                self._outstanding[correlation_id] = request
                try:
                    generation = self._generation
                    channel = self._conn.channel()
                    if generation == self._generation:  # else _setup has just sent it
                        self._publish(channel, correlation_id, request)
                    return
                except CONNECTION_LOST as err:
                    self._conn.reset()
                    error: BaseException = err
                except FedhiveError:
                    self._outstanding.pop(correlation_id, None)
                    raise
            wait = next(delays, None)
            if wait is None:
                self._outstanding.pop(correlation_id, None)
                raise Unavailable(f"request to {request.target} not sent: {error!r}",
                                  field=request.target) from error
            time.sleep(wait)

    def _publish(self, channel: Any, correlation_id: str, request: _Request) -> None:
        request.props.reply_to = self._reply_to  # the current channel's
        try:
            channel.basic_publish(self._exchange, request.target, request.body, request.props,
                                  mandatory=True)
        except pika.exceptions.UnroutableError:
            self._outstanding.pop(correlation_id, None)
            self._file(correlation_id, Unroutable(
                f"no queue bound on exchange {self._exchange!r} for {request.target!r}",
                field=request.target,
            ))

    def _wait(self, seconds: float, ready: Callable[[], bool]) -> None:
        """Until `ready()` (called under `_arrived`) or for at most `seconds`: service the
        connection if no other caller does, else sleep until it files a reply or hands over."""
        with self._arrived:
            if ready():
                return
            if self._servicing:
                self._arrived.wait(seconds)
                return
            self._servicing = True
        try:
            if self._conn.acquire_after_others(seconds):
                try:
                    self._service(seconds, ready)
                finally:
                    self._conn.lock.release()
        finally:
            with self._arrived:
                self._servicing = False
                self._arrived.notify_all()

    def _service(self, seconds: float, ready: Callable[[], bool]) -> None:
        """With the lock: wait for deliveries (replies) for at most `seconds`."""
        with self._arrived:
            if ready():  # filed while this caller waited for the lock
                return
        try:
            self._conn.channel()
            connection = self._conn.connection
            if connection is not None:
                connection.process_data_events(time_limit=seconds)
        except CONNECTION_LOST as err:
            log.info("bus.rpc_connection_lost", error=repr(err))
            self._conn.reset()
        except Unavailable as err:  # broker still away: callers time out on their own deadline
            if not self._conn.closed:
                log.warning("bus.rpc_unavailable", error=str(err))

    def _on_reply(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        request = self._outstanding.get(props.correlation_id)
        if request is None:
            return  # the caller gave up already
        if request.answerers and props.user_id not in request.answerers:
            log.warning("bus.reply_refused", security=True, sender=props.user_id,
                        target=request.target, accepted=sorted(request.answerers))
            return
        del self._outstanding[props.correlation_id]
        self._file(props.correlation_id, reply_of(props, body))

    def _file(self, correlation_id: str, reply: Reply | FedhiveError) -> None:
        with self._arrived:
            self._replies[correlation_id] = reply
            self._arrived.notify_all()


# transport-independent: shared with the in-memory bus (`fedhive.bus.memory`) ----------------
def answerers(topology: Topology, user_id: str, target: str) -> frozenset[str]:
    """The broker users whose reply to a request to `target` is taken; empty: anyone's."""
    if topology.site:
        return frozenset()  # direct reply-to: only the services can publish there
    names = topology.names
    site = names.site_of_queue(target)
    return frozenset({user_id, *([names.site_user(site)] if site else [])})


def unanswered(target: str, timeout: float, *, closed: bool) -> FedhiveError:
    """What a call to `target` ends with when no reply came."""
    if closed:  # the process is shutting down: no reply would have come
        return Unavailable(f"the bus closed while waiting for {target}", field=target)
    return RpcTimeout(f"no reply from {target} within {timeout}s", field=target)


Reply = tuple[str, bytes, Mapping[str, Any]]  # type name, body, headers
Attached = tuple[M, memoryview]  # a reply and its attachment (`fedhive.bus.codec.Encoded`)


def reply_of(props: Any, body: bytes) -> Reply:
    """A reply as it arrived: its type name, body and headers."""
    return props.type or "", body, props.headers or {}


def decode_reply(target: str, reply: Reply | FedhiveError, reply_type: type[M],
                 ) -> Attached[M] | FedhiveError:
    """A reply as `reply_type` (its head merged over its body) with its attachment, or the
    typed error it carries."""
    if isinstance(reply, FedhiveError):
        return reply
    name, body, headers = reply
    try:
        proto, attachment = split(body, headers, queue=target)
        if name == ERROR_TYPE:
            return error_from_message(parse(common_pb2.Error, proto, queue=target))
        if name != reply_type.DESCRIPTOR.full_name:
            raise MalformedMessage(
                f"reply from {target} is a {name or 'message without type'}, "
                f"expected {reply_type.DESCRIPTOR.full_name}",
                field="type",
            )
        head = headers.get(HEAD_HEADER, b"")
        message = merged(reply_type, proto, head if isinstance(head, bytes) else b"",
                         queue=target)
        return message, attachment
    except MalformedMessage as err:
        return err


class RpcCaller(Protocol):
    """What a bus's RPC client offers (`RpcClient`, the in-memory bus's)."""

    def call_many(
        self, requests: Mapping[str, Message | Encoded], reply_type: type[M], *, timeout: float
    ) -> dict[str, Attached[M] | FedhiveError]: ...

    def close(self) -> None: ...


class Calls:
    """A bus's RPC methods of the port (`call`, `call_attached`, `call_many`), over its RPC
    client `_rpc`: one implementation for both buses."""

    _rpc: RpcCaller

    def call(self, queue: str, request: Message | Encoded, reply_type: type[M], *,
             timeout: float) -> M:
        return self.call_attached(queue, request, reply_type, timeout=timeout)[0]

    def call_attached(self, queue: str, request: Message | Encoded, reply_type: type[M], *,
                      timeout: float) -> Attached[M]:
        result = self._rpc.call_many({queue: request}, reply_type, timeout=timeout)[queue]
        if isinstance(result, FedhiveError):
            raise result
        return result

    def call_many(
        self, requests: Mapping[str, Message | Encoded], reply_type: type[M], *, timeout: float
    ) -> dict[str, M | FedhiveError]:
        results = self._rpc.call_many(requests, reply_type, timeout=timeout)
        return {target: result if isinstance(result, FedhiveError) else result[0]
                for target, result in results.items()}
