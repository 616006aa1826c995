"""RabbitMQ adapter: connections closed by the broker, heartbeats during long handlers, and
threads waiting on a connection handing it over."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from google.protobuf.message import Message

from fedhive.bus import Delivery, RabbitBus
from fedhive.bus import consumer as consumer_module
from fedhive.bus import rpc as rpc_module
from fedhive.errors import FedhiveError, Unavailable
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from tests.fixtures.bus import Broker, job_id
from tests.fixtures.infra import wait_for

ABORT = [site_pb2.AbortRequest]


def test_confirmed_publishes_survive_connections_closed_mid_stream(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("stream")
    received: set[str] = set()
    lock = threading.Lock()

    def handler(message: Message, delivery: Delivery) -> None:
        with lock:
            received.add(delivery.message_id or "")

    bus.serve(queue, handler, ABORT, prefetch=20)
    sent: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def publish() -> None:  # publishes until told to stop, across the close
        try:
            while not stop.is_set():
                sent.append(bus.send(queue, site_pb2.AbortRequest(job_id=str(len(sent)))))
        except BaseException as err:
            errors.append(err)

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        wait_for(lambda: len(sent) >= 30, what="publishing to be under way")
        assert broker.close_connections() == 2  # the publisher's and the consumer's
        after_close = len(sent)
        wait_for(lambda: len(sent) >= after_close + 30 or errors, timeout=30,
                 what="publishing to go on after the close")
    finally:
        stop.set()
        publisher.join(60)
    assert errors == []
    wait_for(lambda: received >= set(sent), timeout=30, what="every confirmed message consumed")


def test_consumer_and_rpc_resume_after_the_broker_closes_connections(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    names = Names(namespace)
    commands, rpc = names.site_queue("cmds"), names.site_queue("rpc")
    got: list[str] = []
    consumer = bus.serve(commands, lambda m, d: got.append(job_id(m)), ABORT)
    bus.serve(rpc, lambda m, d: site_pb2.CheckResourcesReply(ok=True, token=job_id(m)),
              [site_pb2.CheckResourcesRequest])
    bus.send(commands, site_pb2.AbortRequest(job_id="before"))
    wait_for(lambda: got == ["before"], what="the first command")
    first = consumer.consuming_since
    assert first is not None
    assert broker.close_connections() == 3  # two consumers and the publisher
    # it may be back within milliseconds (its first retry waits 0.01 s): a new connection's
    # start, not a gap a poll could miss, says it noticed
    wait_for(lambda: (consumer.consuming_since or 0) > first, what="the consumer to reconnect")
    bus.send(commands, site_pb2.AbortRequest(job_id="after"))
    wait_for(lambda: got == ["before", "after"], timeout=20, what="the command after the close")
    assert consumer.consuming
    reply = bus.call(rpc, site_pb2.CheckResourcesRequest(job_id="r"),
                     site_pb2.CheckResourcesReply, timeout=20)
    assert reply.token == "r"


@pytest.mark.parametrize("replicated", [True, False], ids=["quorum", "classic"])
def test_rpc_in_flight_survives_a_close(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str, replicated: bool
) -> None:
    """Also on a classic queue (a job's task queue), whose requests are transient."""
    server, client = make_bus(name="server"), make_bus(name="client")
    queue = Names(namespace).site_queue("inflight")
    entered, release = threading.Event(), threading.Event()

    def handler(message: Message, delivery: Delivery) -> Message:
        entered.set()
        release.wait(30)
        return site_pb2.CheckResourcesReply(ok=True, token=job_id(message))

    server.serve(queue, handler, [site_pb2.CheckResourcesRequest], replicated=replicated)
    result: list[str] = []
    caller = threading.Thread(target=lambda: result.append(client.call(
        queue, site_pb2.CheckResourcesRequest(job_id="x"), site_pb2.CheckResourcesReply,
        timeout=30).token))
    caller.start()
    assert entered.wait(10)
    assert broker.close_connections() == 2  # the reply channel of the request is gone
    release.set()
    caller.join(40)
    assert result == ["x"]  # the request was resent on the new channel and answered


def test_heartbeats_flow_while_a_handler_runs_long(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus(heartbeat=1)  # the broker drops a connection after ~2 silent heartbeats
    queue = Names(namespace).site_queue("long")
    deliveries: list[bool] = []
    finished = threading.Event()

    def handler(message: Message, delivery: Delivery) -> None:
        deliveries.append(delivery.redelivered)
        threading.Event().wait(4)  # the simulated long piece of work
        finished.set()

    consumer = bus.serve(queue, handler, ABORT)
    bus.send(queue, site_pb2.AbortRequest(job_id="slow"))
    assert finished.wait(20)
    consumer.stop()  # an unacked message would go back to the queue now
    assert deliveries == [False]  # delivered once: the connection never dropped
    assert broker.drain(queue) == []  # and acked


def test_a_call_waiting_when_its_bus_closes_ends_at_once(
    make_bus: Callable[..., RabbitBus], namespace: str,
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("silent")
    bus.declare_queue(queue)  # routable, never answered
    ended: list[BaseException] = []

    def call() -> None:
        try:
            bus.call(queue, site_pb2.CheckResourcesRequest(), site_pb2.CheckResourcesReply,
                     timeout=60)
        except FedhiveError as err:
            ended.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: caller.is_alive(), what="the call to be waiting")
    bus.close()
    caller.join(timeout=20)  # far below the call's own 60 s timeout
    assert not caller.is_alive(), "the call kept waiting after its bus closed"
    assert len(ended) == 1 and isinstance(ended[0], Unavailable), ended


def test_stopping_an_idle_consumer_wakes_its_connection_thread(
    make_bus: Callable[..., RabbitBus], namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumer_module, "IDLE_WAKE_S", 600.0)  # idle: never wakes by itself
    bus = make_bus()
    consumer = bus.serve(Names(namespace).site_queue("idle"), lambda *_: None, ABORT)
    wait_for(lambda: consumer.consuming, what="the consumer to consume")
    threading.Event().wait(1)  # its connection thread now waits for the broker
    stopper = threading.Thread(target=consumer.stop)
    stopper.start()
    stopper.join(timeout=20)  # far below its idle wake-up
    assert not stopper.is_alive(), "stop() waited for the idle consumer to wake by itself"


class _HeldCalls:
    """A client bus and a queue whose server answers a request (its job id its token) once the
    test sets that job id's event; `rpc.SLICE` patched to 600 s, so a waiting caller services
    the connection until something wakes it; the call "first" already waiting."""

    def __init__(self, make_bus: Callable[..., RabbitBus], namespace: str,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(rpc_module, "SLICE", 600.0)
        server, self._client = make_bus(name="server"), make_bus(name="client")
        self._queue = Names(namespace).site_queue("held")
        releases = self.releases = {name: threading.Event() for name in ("first", "second")}
        self.tokens: list[str] = []

        def handler(message: Message, delivery: Delivery) -> Message:
            releases[job_id(message)].wait(60)
            return site_pb2.CheckResourcesReply(ok=True, token=job_id(message))

        server.serve(self._queue, handler, [site_pb2.CheckResourcesRequest], prefetch=2,
                     concurrency=2)
        self.first = self.call("first")
        threading.Event().wait(1)  # the first caller now services the connection, waiting

    def call(self, name: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: self.tokens.append(self._client.call(
            self._queue, site_pb2.CheckResourcesRequest(job_id=name),
            site_pb2.CheckResourcesReply, timeout=120).token))
        thread.start()
        return thread


def test_a_call_is_sent_while_another_caller_waits_on_the_connection(
    make_bus: Callable[..., RabbitBus], namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = _HeldCalls(make_bus, namespace, monkeypatch)
    held.releases["second"].set()
    second = held.call("second")
    second.join(timeout=20)  # far below the first caller's slice
    assert held.tokens == ["second"], "the second call waited for the first caller's slice"
    held.releases["first"].set()
    held.first.join(timeout=20)
    assert held.tokens == ["second", "first"]


def test_a_waiting_call_takes_over_the_connection_from_one_answered(
    make_bus: Callable[..., RabbitBus], namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = _HeldCalls(make_bus, namespace, monkeypatch)
    second = held.call("second")
    threading.Event().wait(1)  # the second caller sleeps while the first services
    held.releases["first"].set()
    held.first.join(timeout=20)
    assert held.tokens == ["first"]
    held.releases["second"].set()  # nobody reads this reply unless the second caller took over
    second.join(timeout=20)
    assert held.tokens == ["first", "second"], "no caller serviced the connection after the first"
