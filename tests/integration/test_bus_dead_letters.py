"""RabbitMQ adapter: what is dead-lettered, when, and that the consumer keeps going."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pika
import pytest
from google.protobuf.message import Message

from fedhive.bus import Delivery, RabbitBus
from fedhive.bus.codec import CONTENT_TYPE
from fedhive.bus.publisher import properties
from fedhive.config import Settings
from fedhive.errors import (
    ConfigError,
    InvalidArgument,
    PermissionDenied,
    RpcTimeout,
)
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, site_pb2
from fedhive.retry import Backoff
from tests.fixtures.bus import Broker, job_id
from tests.fixtures.infra import wait_for

ABORT = [site_pb2.AbortRequest]


def dead_letters(broker: Broker, queue: str, count: int) -> list[tuple[Any, bytes]]:
    taken: list[tuple[Any, bytes]] = []

    def enough() -> bool:
        taken.extend(broker.drain(Names.dead_letter_queue(queue)))
        return len(taken) >= count

    wait_for(enough, timeout=20, what=f"{count} dead letters of {queue}")
    return taken


@pytest.mark.parametrize("replicated", [True, False], ids=["quorum", "classic"])
def test_poison_message_is_dead_lettered_after_the_delivery_limit(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str, replicated: bool
) -> None:
    """A quorum queue's broker counts deliveries; on a classic queue the consumer does."""
    bus = make_bus(delivery_limit=3, redelivery=Backoff(base=0.01, cap=0.05))
    queue = Names(namespace).site_queue("a")
    attempts: Counter[str] = Counter()
    done: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, site_pb2.AbortRequest)
        attempts[message.job_id] += 1
        if message.job_id == "poison":
            raise RuntimeError("always fails")
        done.append(message.job_id)

    bus.serve(queue, handler, ABORT, replicated=replicated)
    assert broker.queue_type(queue) == ("quorum" if replicated else "classic")
    poison_id = bus.send(queue, site_pb2.AbortRequest(job_id="poison"))
    for i in range(3):
        bus.send(queue, site_pb2.AbortRequest(job_id=f"good-{i}"))
    [(props, body)] = dead_letters(broker, queue, 1)
    assert props.message_id == poison_id
    assert site_pb2.AbortRequest.FromString(body).job_id == "poison"
    assert attempts["poison"] == 4  # first delivery + 3 redeliveries, then it is given up
    wait_for(lambda: sorted(done) == ["good-0", "good-1", "good-2"], what="the good messages")
    bus.send(queue, site_pb2.AbortRequest(job_id="after"))
    wait_for(lambda: "after" in done, what="a message after the poison one")


def test_malformed_messages_are_dead_lettered_with_their_bytes(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("b")
    done: list[str] = []
    bus.serve(queue, lambda m, d: done.append(job_id(m)), ABORT)
    garbage = b"\xff\xff\xff\x00not protobuf"
    channel = broker.channel()
    try:
        cmd = Names(namespace).cmd_exchange
        for message_id, type_name, body in [
            ("bad-body", "fedhive.v1.AbortRequest", garbage),
            ("no-type", None, site_pb2.AbortRequest(job_id="x").SerializeToString()),
            ("wrong-type", "fedhive.v1.DeployRequest", b"\x0a\x01x"),
        ]:
            props = pika.BasicProperties(content_type=CONTENT_TYPE, type=type_name,
                                         message_id=message_id, user_id=bus.user)
            channel.basic_publish(cmd, queue, body, props)
    finally:
        channel.connection.close()
    bus.send(queue, site_pb2.AbortRequest(job_id="fine"))
    letters = {props.message_id: body for props, body in dead_letters(broker, queue, 3)}
    assert letters == {
        "bad-body": garbage,
        "no-type": site_pb2.AbortRequest(job_id="x").SerializeToString(),
        "wrong-type": b"\x0a\x01x",
    }
    wait_for(lambda: done == ["fine"], what="the well-formed message")


def test_messages_from_senders_a_queue_does_not_accept_are_dropped_and_answered(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str,
    rogue_settings: Settings, capsys: pytest.CaptureFixture[str],
) -> None:
    """Unsigned, or signed by a user the queue does not take: never handled, never
    dead-lettered (the sender could fill the dead-letter queue), logged as a security event; an
    RPC request gets PERMISSION_DENIED."""
    bus = make_bus()
    queue = Names(namespace).site_queue("d")
    done: list[str] = []
    bus.serve(queue, lambda m, d: done.append(job_id(m)), ABORT)
    channel = broker.channel()
    try:
        message = site_pb2.AbortRequest(job_id="unsigned")
        channel.basic_publish(Names(namespace).cmd_exchange, queue, message.SerializeToString(),
                              properties(message, message_id="unsigned"))
    finally:
        channel.connection.close()
    rogue = RabbitBus(rogue_settings, name="rogue", site=True)  # direct reply-to: no service
    try:
        rogue.send(queue, site_pb2.AbortRequest(job_id="rogue"), message_id="rogue-command")
        with pytest.raises(PermissionDenied, match=f"{queue} does not accept messages from "
                                                   f"broker user {rogue.user!r}"):
            rogue.call(queue, site_pb2.AbortRequest(job_id="rogue-rpc"), common_pb2.Ack,
                       timeout=10)
    finally:
        rogue.close()
    bus.send(queue, site_pb2.AbortRequest(job_id="fine"))
    wait_for(lambda: done == ["fine"], what="the message of the queue's own user")
    assert broker.drain(Names.dead_letter_queue(queue)) == []
    refused = [line for line in capsys.readouterr().out.splitlines()
               if "bus.sender_refused" in line]
    assert len(refused) == 3 and all("security=True" in line for line in refused)


def test_domain_error_on_a_command_is_dead_lettered_at_once(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("c")
    calls: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        calls.append(delivery.message_id or "")
        raise InvalidArgument("job_id must not be empty", field="job_id")

    bus.serve(queue, handler, ABORT)
    sent = bus.send(queue, site_pb2.AbortRequest())
    [(props, _)] = dead_letters(broker, queue, 1)
    assert props.message_id == sent
    assert calls == [sent]  # never retried


def test_expired_rpc_request_is_not_served_late(
    make_bus: Callable[..., RabbitBus], namespace: str
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("late")
    bus.declare_queue(queue)
    with pytest.raises(RpcTimeout):
        bus.call(queue, site_pb2.CheckResourcesRequest(job_id="stale"),
                 site_pb2.CheckResourcesReply, timeout=0.3)
    served: list[str] = []

    def handler(message: Message, delivery: Delivery) -> Message:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        served.append(message.job_id)
        return site_pb2.CheckResourcesReply(ok=True)

    bus.serve(queue, handler, [site_pb2.CheckResourcesRequest])
    assert bus.call(queue, site_pb2.CheckResourcesRequest(job_id="fresh"),
                    site_pb2.CheckResourcesReply, timeout=10).ok
    assert served == ["fresh"]  # the stale request expired in the queue (queues are FIFO)


def test_every_message_carries_the_verified_user(
    make_bus: Callable[..., RabbitBus], namespace: str, bus_settings: Settings
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("signed")
    users: list[str | None] = []
    bus.serve(queue, lambda m, d: users.append(d.user_id), ABORT)
    bus.send(queue, site_pb2.AbortRequest(job_id="j"))
    wait_for(lambda: users, what="the signed command")
    assert users == [pika.URLParameters(bus_settings.amqp_url).credentials.username]


def test_stop_lets_the_running_handler_finish_and_ack(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    queue = Names(namespace).site_queue("stop")
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        started.set()
        release.wait(30)
        finished.append(job_id(message))

    consumer = bus.serve(queue, handler, ABORT)
    bus.send(queue, site_pb2.AbortRequest(job_id="long"))
    assert started.wait(10)
    stopper = threading.Thread(target=consumer.stop)
    stopper.start()
    wait_for(lambda: not consumer.consuming, what="the consumer to stop taking messages")
    assert stopper.is_alive()  # still waiting for the handler
    release.set()
    stopper.join(10)
    assert not stopper.is_alive() and finished == ["long"]
    assert broker.drain(queue) == []  # acked, not requeued


def test_topology_has_the_exchanges_and_a_dead_letter_queue_per_queue(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    bus = make_bus()
    names = Names(namespace)
    bus.declare_queue(names.service_queue("scheduler"))
    bus.declare_queue(names.service_queue("scheduler"))
    bus.subscribe("scheduler", ["job.status.*"], lambda m, d: None, ABORT)
    queues, exchanges = broker.declared()
    assert sorted(exchanges) == sorted([names.cmd_exchange, names.events_exchange,
                                        names.dead_letter_exchange, names.replies_exchange])
    assert sorted(queues) == sorted([
        names.service_queue("scheduler"), Names.dead_letter_queue(names.service_queue("scheduler")),
        names.events_queue("scheduler"), Names.dead_letter_queue(names.events_queue("scheduler")),
    ])


def test_a_sites_bus_declares_nothing_and_names_a_missing_queue(
    make_bus: Callable[..., RabbitBus], broker: Broker, namespace: str
) -> None:
    """A site's user may configure nothing (`fedhive.brokerusers`): its bus only checks that its
    queue is there (the provisioning declared and bound it), and says how to provision it when it
    is not, at once."""
    names = Names(namespace)
    queue = names.site_queue("s")
    site = make_bus(site=True)
    with pytest.raises(ConfigError) as missing:
        site.serve(queue, lambda m, d: None, ABORT)
    assert str(missing.value) == (
        f"queue '{queue}' does not exist on the broker (a site declares none): provision site "
        f"'s' first, e.g. `python deploy/broker_users.py --namespace {namespace} create s "
        "--credentials FILE` creates its broker user and its queue")
    assert broker.declared() == ([], [])  # not even an exchange
    services = make_bus()
    services.declare_queue(names.service_queue("job-store"))  # the services' exchanges
    spec = site.topology.command_queue(queue)
    channel = broker.channel()  # what the provisioning declares for the site
    try:
        channel.queue_declare(queue, durable=True, arguments=site.topology.queue_arguments(spec))
        channel.queue_bind(queue, names.cmd_exchange, routing_key=queue)
    finally:
        channel.connection.close()
    done: list[str] = []
    site.serve(queue, lambda m, d: done.append(job_id(m)), ABORT)
    services.send(queue, site_pb2.AbortRequest(job_id="to-the-site"))
    wait_for(lambda: done == ["to-the-site"], what="the command on the provisioned queue")
    queues, _ = broker.declared()
    assert Names.dead_letter_queue(queue) not in queues
