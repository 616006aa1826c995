"""`RabbitBus`: the bus port on RabbitMQ, built from `Settings` by a composition root."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import pika
import pika.exceptions
from google.protobuf.message import Message

from fedhive.bus.batch import BatchConsumer, BatchHandler
from fedhive.bus.codec import TypeRegistry
from fedhive.bus.connection import DEFAULT_HEARTBEAT, connect, connection_parameters, user_name
from fedhive.bus.consumer import REDELIVERY, Consumer
from fedhive.bus.delivery import Handler, Quick
from fedhive.bus.publisher import REPUBLISH, Publisher
from fedhive.bus.rpc import Calls, RpcClient
from fedhive.bus.senders import Senders
from fedhive.bus.topology import CLASSIC, DEFAULT_DELIVERY_LIMIT, QUORUM, QueueSpec, Topology
from fedhive.config import Settings
from fedhive.errors import Unavailable
from fedhive.names import Names
from fedhive.retry import Backoff


class RabbitBus(Calls):
    """Publisher, RPC client and consumers of one process, each on its own connection.

    Every message this bus sends (commands, events, RPC requests and replies) carries the AMQP
    `user_id` of the connection's user, which RabbitMQ verifies; every queue it consumes
    accepts only the senders it is given (by default its own user: services talk to services).
    `site=True` for a site's processes (site agent, client job): a site's user may configure
    nothing (exchanges and its control queue are checked passively) and has no reply queue
    (`fedhive.bus.topology`, `fedhive.bus.rpc`). An `amqps://`
    URL is verified against `settings.amqp_ca_file` (`fedhive.bus.connection`).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str = "fedhive",
        site: bool = False,
        delivery_limit: int = DEFAULT_DELIVERY_LIMIT,
        heartbeat: int = DEFAULT_HEARTBEAT,
        republish: Backoff = REPUBLISH,
        redelivery: Backoff = REDELIVERY,
    ) -> None:
        self.names = Names(settings.namespace)
        self.topology = Topology(self.names, delivery_limit=delivery_limit, site=site)
        self._url = settings.amqp_url
        self._ca_file = settings.amqp_ca_file
        self._name = f"{settings.namespace}.{name}"
        self._heartbeat = heartbeat
        self._redelivery = redelivery
        self._republish = republish
        self.user = user_name(self._params("user"))
        self._publisher = Publisher(self._params("publisher"), self.topology, backoff=republish)
        self._rpc = RpcClient(self._params("rpc"), self.topology, backoff=republish)
        self._consumers: list[Consumer | BatchConsumer] = []
        self._lock = threading.Lock()

    def _params(self, role: str) -> pika.URLParameters:
        return connection_parameters(self._url, name=f"{self._name}.{role}",
                                     ca_file=self._ca_file, heartbeat=self._heartbeat)

    def declare_queue(self, queue: str, binding_keys: Sequence[str] = ()) -> None:
        with connect(self._params("declare"), self._republish) as connection:
            self.topology.declare_queue(
                connection.channel(), self.topology.command_queue(queue, binding_keys)
            )

    def delete_queue(self, queue: str) -> None:
        try:
            with connect(self._params("declare"), self._republish) as connection:
                channel = connection.channel()
                for name in (queue, Names.dead_letter_queue(queue)):
                    channel.queue_delete(queue=name)
        except pika.exceptions.AMQPError as err:
            raise Unavailable(f"could not delete queue {queue}: {err!r}", field=queue) from err

    def send(self, queue: str, message: Message, *, message_id: str | None = None) -> str:
        return self._publisher.publish(self.names.cmd_exchange, queue, message,
                                       message_id=message_id)

    def publish_event(
        self, routing_key: str, message: Message, *, message_id: str | None = None
    ) -> str:
        # An event is a broadcast: no subscriber yet is normal, not an error (commands are
        # mandatory: a command nobody can receive raises Unroutable).
        return self._publisher.publish(self.names.events_exchange, routing_key, message,
                                       message_id=message_id, mandatory=False)

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
    ) -> Consumer:
        spec = self.topology.command_queue(queue, binding_keys,
                                           queue_type=QUORUM if replicated else CLASSIC)
        return self._start(spec, handler, accepts, senders, prefetch, concurrency, quick)

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
    ) -> Consumer:
        spec = self.topology.events_queue(consumer, patterns)
        return self._start(spec, handler, accepts, senders, prefetch, concurrency)

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
    ) -> BatchConsumer:
        spec = self.topology.events_queue(consumer, patterns)
        batches = BatchConsumer(
            self._params(f"batches.{spec.name}"), self.topology, spec, TypeRegistry(accepts),
            handle_batch, senders or Senders.only(self.user), max_batch=max_batch,
            max_wait_s=max_wait_s,
        )
        batches.start()
        with self._lock:
            self._consumers.append(batches)
        return batches

    def _start(
        self,
        spec: QueueSpec,
        handler: Handler,
        accepts: Iterable[type[Message]],
        senders: Senders | None,
        prefetch: int,
        concurrency: int,
        quick: Quick | None = None,
    ) -> Consumer:
        consumer = Consumer(
            self._params(f"consumer.{spec.name}"), self.topology, spec, handler,
            TypeRegistry(accepts), senders or Senders.only(self.user), prefetch=prefetch,
            concurrency=concurrency, quick=quick, redelivery=self._redelivery,
        )
        consumer.start()
        with self._lock:
            self._consumers.append(consumer)
        return consumer

    def close(self) -> None:
        with self._lock:
            consumers, self._consumers = self._consumers, []
        for consumer in consumers:
            consumer.stop()
        self._rpc.close()
        self._publisher.close()
