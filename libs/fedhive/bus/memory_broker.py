"""`MemoryBroker`: RabbitMQ's part of the in-memory bus (`fedhive.bus.memory`), in one process.

Exchanges (topic ones with RabbitMQ's `*`/`#` matching, direct ones for dead letters), queues
with RabbitMQ's `x-dead-letter-*` and `x-delivery-limit` arguments, per-message expiration, and
the sender's identity: every message carries the user of the bus that sent it as `user_id`,
whatever the message said, as RabbitMQ verifies it. Replies to RPC requests go straight to the
client listening at the reply address, as RabbitMQ's direct reply-to and the services' reply
queues deliver them.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pika
import structlog

log = structlog.get_logger()

Listener = Callable[[pika.BasicProperties, bytes], None]


def topic_matches(pattern: str, routing_key: str) -> bool:
    """RabbitMQ's topic matching: words split on `.`, `*` is exactly one word, `#` zero or
    more; an empty key has no words (so only `#` and the empty pattern match it)."""
    words, parts = _words(routing_key), _words(pattern)
    states = _skip_hashes(parts, {0})
    for word in words:
        states = _skip_hashes(parts, {
            i + (parts[i] != "#") for i in states
            if i < len(parts) and parts[i] in ("#", "*", word)})
        if not states:
            return False
    return len(parts) in states


def _words(key: str) -> list[str]:
    return key.split(".") if key else []


def _skip_hashes(parts: list[str], states: set[int]) -> set[int]:
    """`states` plus every position reached by letting a `#` match no word."""
    todo, reached = list(states), set(states)
    while todo:
        i = todo.pop()
        if i < len(parts) and parts[i] == "#" and i + 1 not in reached:
            reached.add(i + 1)
            todo.append(i + 1)
    return reached


@dataclass
class Queued:
    """A message in a queue: each queue it was routed to holds its own copy."""

    routing_key: str
    body: bytes
    props: pika.BasicProperties
    expires_at: float | None  # time.monotonic() past which it is dead ("expiration")
    redelivered: bool = False
    failures: int = 0  # unsuccessful deliveries so far (a quorum queue's x-delivery-count)


@dataclass
class _Queue:
    dead_letter: tuple[str, str] | None  # (exchange, routing key)
    delivery_limit: int | None
    messages: deque[Queued] = field(default_factory=deque)


class MemoryBroker:
    """The in-process broker that several `MemoryBus`es (one per user) share; thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()  # guards everything below
        self._exchanges: dict[str, str] = {}  # name -> kind ("topic" or "direct")
        self._bindings: dict[str, set[tuple[str, str]]] = {}  # exchange -> {(key, queue)}
        self._queues: dict[str, _Queue] = {}
        self._listeners: dict[str, Listener] = {}  # RPC reply address -> its client

    def declare_exchange(self, name: str, kind: str) -> None:
        with self._changed:
            self._exchanges.setdefault(name, kind)
            self._bindings.setdefault(name, set())

    def declare_queue(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Declared with RabbitMQ's `x-dead-letter-*` and `x-delivery-limit` arguments; a
        queue already there is kept as it is."""
        dlx = arguments.get("x-dead-letter-exchange")
        with self._changed:
            self._queues.setdefault(name, _Queue(
                (dlx, arguments.get("x-dead-letter-routing-key", name)) if dlx else None,
                arguments.get("x-delivery-limit")))

    def bind(self, queue: str, exchange: str, key: str) -> None:
        with self._changed:
            self._bindings[exchange].add((key, queue))

    def delete_queue(self, name: str) -> None:
        """The queue, its messages and its bindings; a missing queue is not an error."""
        with self._changed:
            self._queues.pop(name, None)
            for bindings in self._bindings.values():
                bindings -= {binding for binding in bindings if binding[1] == name}

    def publish(
        self, user: str, exchange: str, routing_key: str, body: bytes,
        props: pika.BasicProperties,
    ) -> bool:
        """A copy to every queue bound for `routing_key`, sent by `user`; False when none is."""
        with self._changed:
            return self._route(exchange, routing_key, body, _signed(props, user))

    def reply(self, user: str, address: str, body: bytes, props: pika.BasicProperties) -> None:
        """An RPC reply from `user`; dropped when nobody listens at `address` any more."""
        with self._changed:
            listener = self._listeners.get(address)
        if listener is not None:
            listener(_signed(props, user), body)

    def listen(self, address: str, listener: Listener) -> None:
        with self._changed:
            self._listeners[address] = listener

    def unlisten(self, address: str) -> None:
        with self._changed:
            self._listeners.pop(address, None)

    def take(self, queue: str, timeout: float) -> Queued | None:
        """The next live message of `queue`, waiting up to `timeout`; expired ones are
        dead-lettered on the way, as RabbitMQ does. `LookupError` if there is no such queue."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                held = self._queues.get(queue)
                if held is None:
                    raise LookupError(queue)
                while held.messages:
                    message = held.messages.popleft()
                    if message.expires_at is None or time.monotonic() < message.expires_at:
                        return message
                    self._dead_letter(held, message)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def requeue(self, queue: str, message: Queued) -> None:
        """A failed delivery: back to the head of `queue`, or dead-lettered past its limit."""
        message.failures += 1
        message.redelivered = True
        message.props.headers = {**(message.props.headers or {}),
                                 "x-delivery-count": message.failures}
        with self._changed:
            held = self._queues.get(queue)
            if held is None:
                return
            if held.delivery_limit is not None and message.failures > held.delivery_limit:
                log.warning("bus.dead_letter_delivery_limit", queue=queue,
                            message_id=message.props.message_id, deliveries=message.failures)
                self._dead_letter(held, message)
                return
            held.messages.appendleft(message)
            self._changed.notify_all()

    def dead_letter(self, queue: str, message: Queued) -> None:
        with self._changed:
            held = self._queues.get(queue)
            if held is not None:
                self._dead_letter(held, message)

    def drain(self, queue: str) -> list[tuple[pika.BasicProperties, bytes]]:
        """Take every message now in `queue` (e.g. to look at dead letters)."""
        with self._changed:
            held = self._queues.get(queue)
            taken = list(held.messages) if held is not None else []
            if held is not None:
                held.messages.clear()
        return [(message.props, message.body) for message in taken]

    def _dead_letter(self, held: _Queue, message: Queued) -> None:
        if held.dead_letter is not None:
            exchange, key = held.dead_letter
            self._route(exchange, key, message.body, message.props)

    def _route(self, exchange: str, routing_key: str, body: bytes,
               props: pika.BasicProperties) -> bool:
        direct = self._exchanges.get(exchange) == "direct"
        queues = {queue for key, queue in self._bindings.get(exchange, ())
                  if (key == routing_key if direct else topic_matches(key, routing_key))}
        expiration = props.expiration
        expires_at = None if expiration is None else time.monotonic() + int(expiration) / 1000
        for queue in queues:  # each its own copy: a consumer may change the headers
            self._queues[queue].messages.append(
                Queued(routing_key, body, copy.deepcopy(props), expires_at))
        if queues:
            self._changed.notify_all()
        return bool(queues)


def _signed(props: pika.BasicProperties, user: str) -> pika.BasicProperties:
    signed = copy.deepcopy(props)
    signed.user_id = user
    return signed
