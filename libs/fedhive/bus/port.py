"""The bus port: what services and domain code see of messaging. `RabbitBus` is the adapter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from google.protobuf.message import Message

from fedhive.bus.batch import BatchHandler
from fedhive.bus.codec import Encoded
from fedhive.bus.delivery import Handler, Quick
from fedhive.bus.senders import Senders
from fedhive.errors import FedhiveError
from fedhive.names import Names

M = TypeVar("M", bound=Message)


class Subscription(Protocol):
    @property
    def queue(self) -> str:
        """The queue it consumes."""

    @property
    def consuming(self) -> bool:
        """Whether deliveries can arrive right now (what a readiness check asks)."""

    @property
    def consuming_since(self) -> float | None:
        """`time.monotonic()` when the current connection began consuming; None while
        (re)connecting: what it missed meanwhile is not known."""

    def stop(self) -> None:
        """Stop consuming, let the running handler finish, release the connection."""


class Bus(Protocol):
    user: str  # this bus's broker user: what every message it sends carries as `user_id`
    names: Names  # the namespace's queue and exchange names

    def declare_queue(self, queue: str, binding_keys: Sequence[str] = ()) -> None:
        """Declare a command queue (and its dead-letter queue) without consuming from it."""

    def delete_queue(self, queue: str) -> None:
        """Delete a command queue and its dead-letter queue (messages in them are dropped);
        deleting a missing queue is not an error."""

    def send(self, queue: str, message: Message, *, message_id: str | None = None) -> str:
        """A one-way command to `queue`, confirmed by the broker; returns the message id."""

    def publish_event(
        self, routing_key: str, message: Message, *, message_id: str | None = None
    ) -> str:
        """An event on the events exchange (e.g. `job.status.RUNNING`), confirmed by the broker;
        returns the message id. An event no subscriber matches is dropped, not an error."""

    def call(self, queue: str, request: Message | Encoded, reply_type: type[M], *,
             timeout: float) -> M:
        """RPC: raises `RpcTimeout`, `Unroutable` or the server's typed error."""

    def call_attached(self, queue: str, request: Message | Encoded, reply_type: type[M], *,
                      timeout: float) -> tuple[M, memoryview]:
        """`call`, and the reply's attachment (empty when it has none): what its attached
        refs name (`fedhive.bus.codec.Encoded`)."""

    def call_many(
        self, requests: Mapping[str, Message | Encoded], reply_type: type[M], *, timeout: float
    ) -> dict[str, M | FedhiveError]:
        """RPC to several queues at once under one timeout: per queue the reply or the error."""

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
    ) -> Subscription:
        """Consume commands and RPC requests from `queue` (declared if needed); started.

        `senders`: whose messages it takes (default: this bus's own user); the rest are refused
        (`fedhive.bus.delivery`). `replicated=False` declares a cheaper queue that a broker
        node's loss may take with it (a job's task queue; see `fedhive.bus.topology`).
        `quick`: the messages whose handling is short and waits on nothing, which a transport
        with an I/O thread may handle on it instead of handing them to a handler thread."""

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
    ) -> Subscription:
        """Consume events matching `patterns` on the queue `Names.events_queue(consumer)`, from
        `senders` (default: this bus's own user)."""

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
    ) -> Subscription:
        """Like `subscribe`, for high-rate events: `handle_batch` gets up to `max_batch`
        messages gathered for at most `max_wait_s`, on the connection's own thread (keep it
        quick), and the batch is acked at once (requeued if it raises)."""

    def close(self) -> None:
        """Stop every subscription and close every connection."""
