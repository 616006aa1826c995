"""The in-memory bus: RabbitMQ's topic matching, and what the contract suite
(tests/integration/test_bus_contract.py, which runs on `MemoryBus` too) leaves to the adapters'
own tests: identity, sender checks, redelivery and dead letters, batches, stopping."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pika
import pytest
from google.protobuf.message import Message

from fedhive.bus import Delivery, MemoryBroker, MemoryBus, Senders
from fedhive.bus.codec import CONTENT_TYPE
from fedhive.bus.memory_broker import topic_matches
from fedhive.bus.publisher import properties
from fedhive.errors import (
    InvalidArgument,
    PermissionDenied,
    RpcTimeout,
    Unavailable,
)
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, site_pb2
from fedhive.retry import Backoff
from tests.fixtures.bus import job_id
from tests.fixtures.infra import wait_for

NAMES = Names("t")
ABORT = [site_pb2.AbortRequest]
FAST = Backoff(base=0.01, cap=0.02)


@pytest.mark.parametrize(("pattern", "key", "matches"), [
    ("job.status.RUNNING", "job.status.RUNNING", True),
    ("job.status.RUNNING", "job.status.FAILED", False),
    ("job.status.*", "job.status.RUNNING", True),
    ("job.status.*", "job.status", False),  # `*` is exactly one word
    ("job.status.*", "job.status.FINISHED.COMPLETED", False),
    ("job.*.RUNNING", "job.status.RUNNING", True),
    ("*", "a", True),
    ("*", "", False),  # an empty key has no words
    ("*", "a.b", False),
    ("site.#", "site", True),  # `#` is zero or more words
    ("site.#", "site.online", True),
    ("site.#", "site.a.heartbeat", True),
    ("site.#", "sites.online", False),
    ("#", "", True),
    ("#", "a.b.c", True),
    ("", "", True),
    ("", "a", False),
    ("#.server", "t.job.j1.server", True),
    ("#.server", "t.job.j1.server.site", False),
    ("a.#.z", "a.z", True),
    ("a.#.z", "a.b.c.z", True),
    ("a.#.z", "a.b.c", False),
    ("a.#.#.z", "a.b.z", True),
    ("#.*.#", "", False),  # needs one word somewhere
    ("#.*.#", "x", True),
    ("a.*.c", "a..c", True),  # an empty word is a word
    ("a.*", "a.", True),
    ("t.job.j.server.site-1", "t.job.j.server.site-1", True),
])
def test_topic_matching_follows_rabbitmq(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


@pytest.fixture
def broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
def buses(broker: MemoryBroker) -> Iterator[dict[str, MemoryBus]]:
    """`services`, two sites `a` and `b`, and `fragile` (delivery limit 3): all on `broker`."""
    made = {
        "services": MemoryBus(broker, "services", NAMES, redelivery=FAST),
        "a": MemoryBus(broker, NAMES.site_user("a"), NAMES),
        "b": MemoryBus(broker, NAMES.site_user("b"), NAMES),
        "fragile": MemoryBus(broker, "services", NAMES, delivery_limit=3, redelivery=FAST),
    }
    yield made
    for bus in made.values():
        bus.close()


def check(message: Message, delivery: Delivery) -> site_pb2.CheckResourcesReply:
    assert isinstance(message, site_pb2.CheckResourcesRequest)
    return site_pb2.CheckResourcesReply(ok=True, token=f"{delivery.user_id}:{message.job_id}")


def test_the_broker_stamps_the_senders_user_whatever_the_message_says(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.service_queue("job-runner")
    users: list[str | None] = []
    buses["services"].serve(queue, lambda m, d: users.append(d.user_id), ABORT,
                            senders=Senders.any_site(NAMES))
    message = site_pb2.AbortRequest(job_id="j")
    forged = properties(message, user_id=NAMES.site_user("b"))
    assert broker.publish(NAMES.site_user("a"), NAMES.cmd_exchange, queue,
                          message.SerializeToString(), forged)
    buses["b"].send(queue, message)
    wait_for(lambda: len(users) == 2, what="both commands")
    assert sorted(u or "" for u in users) == [NAMES.site_user("a"), NAMES.site_user("b")]


def test_handlers_get_fresh_objects_and_the_same_properties_as_on_rabbitmq(
    buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.site_queue("a")
    got: list[tuple[Message, Delivery]] = []
    buses["a"].serve(queue, lambda m, d: got.append((m, d)), ABORT,
                     senders=Senders.only("services"))
    sent = site_pb2.AbortRequest(job_id="j", reason="r")
    message_id = buses["services"].send(queue, sent)
    wait_for(lambda: got, what="the command")
    [(message, delivery)] = got
    assert message == sent and message is not sent
    assert delivery.message_id == message_id and delivery.type_name == "fedhive.v1.AbortRequest"
    assert delivery.routing_key == queue and not delivery.redelivered
    assert delivery.delivery_count == 0 and delivery.timestamp


def test_messages_from_senders_a_queue_does_not_accept_are_dropped_and_answered(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.service_queue("job-store")
    done: list[str] = []
    buses["services"].serve(queue, lambda m, d: done.append(job_id(m)), ABORT)
    buses["a"].send(queue, site_pb2.AbortRequest(job_id="from-a"))
    with pytest.raises(PermissionDenied, match=f"{queue} does not accept messages from broker "
                                               f"user '{NAMES.site_user('a')}'"):
        buses["a"].call(queue, site_pb2.AbortRequest(job_id="rpc-from-a"), common_pb2.Ack,
                        timeout=10)
    buses["services"].send(queue, site_pb2.AbortRequest(job_id="fine"))
    wait_for(lambda: done == ["fine"], what="the message of the queue's own user")
    assert broker.drain(Names.dead_letter_queue(queue)) == []  # dropped, not dead-lettered


def test_sites_and_services_call_each_other(buses: dict[str, MemoryBus]) -> None:
    """A site's bus replies through direct reply-to addresses, the services' through their reply
    queues, and a consumer checks them as RabbitMQ's does."""
    services, site = buses["services"], buses["a"]
    site.serve(NAMES.site_queue("a"), check, [site_pb2.CheckResourcesRequest],
               senders=Senders.only("services"))
    services.serve(NAMES.service_queue("job-runner"), check, [site_pb2.CheckResourcesRequest],
                   senders=Senders.any_site(NAMES))
    to_site = services.call(NAMES.site_queue("a"), site_pb2.CheckResourcesRequest(job_id="1"),
                            site_pb2.CheckResourcesReply, timeout=10)
    to_services = site.call(NAMES.service_queue("job-runner"),
                            site_pb2.CheckResourcesRequest(job_id="2"),
                            site_pb2.CheckResourcesReply, timeout=10)
    assert to_site.token == "services:1" and to_services.token == f"{NAMES.site_user('a')}:2"


def test_a_site_cannot_answer_for_another(buses: dict[str, MemoryBus]) -> None:
    """A services caller takes a reply for site a's queue only from site a (or the services)."""
    answered: list[str | None] = []

    def impostor(message: Message, delivery: Delivery) -> Message:
        answered.append(delivery.user_id)
        return check(message, delivery)

    buses["b"].serve(NAMES.site_queue("a"), impostor, [site_pb2.CheckResourcesRequest],
                     senders=Senders.only("services"))
    with pytest.raises(RpcTimeout):
        buses["services"].call(NAMES.site_queue("a"), site_pb2.CheckResourcesRequest(job_id="j"),
                               site_pb2.CheckResourcesReply, timeout=0.5)
    wait_for(lambda: answered == ["services"], what="the impostor's answer, refused")


def test_a_site_cannot_have_a_site_answer_it(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    """A site's consumer may not publish to direct reply-to: a request asking for that is
    malformed for it, dead-lettered with no answer (its own queue has no dead-letter queue)."""
    served: list[str] = []
    buses["b"].serve(NAMES.site_queue("b"), lambda m, d: served.append(job_id(m)),
                     [site_pb2.CheckResourcesRequest], senders=Senders.any_site(NAMES))
    with pytest.raises(RpcTimeout):
        buses["a"].call(NAMES.site_queue("b"), site_pb2.CheckResourcesRequest(job_id="j"),
                        site_pb2.CheckResourcesReply, timeout=0.5)
    assert served == []


def test_poison_message_is_dead_lettered_after_the_delivery_limit(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.site_queue("a")
    attempts: Counter[str] = Counter()
    counts: list[tuple[int, bool]] = []
    done: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        attempts[job_id(message)] += 1
        if job_id(message) == "poison":
            counts.append((delivery.delivery_count, delivery.redelivered))
            raise RuntimeError("always fails")
        done.append(job_id(message))

    bus = buses["fragile"]
    bus.serve(queue, handler, ABORT, replicated=False)
    poison_id = bus.send(queue, site_pb2.AbortRequest(job_id="poison"))
    for i in range(3):
        bus.send(queue, site_pb2.AbortRequest(job_id=f"good-{i}"))
    letters = wait_for(lambda: broker.drain(Names.dead_letter_queue(queue)),
                       what="the dead letter")
    [(props, body)] = letters
    assert props.message_id == poison_id and props.user_id == "services"
    assert site_pb2.AbortRequest.FromString(body).job_id == "poison"
    assert attempts["poison"] == 4  # first delivery + 3 redeliveries, then it is given up
    assert counts == [(0, False), (1, True), (2, True), (3, True)]
    wait_for(lambda: sorted(done) == ["good-0", "good-1", "good-2"], what="the good messages")


def test_domain_errors_dead_letter_a_command_at_once_and_unavailable_is_retried(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.site_queue("a")
    calls: Counter[str] = Counter()

    def handler(message: Message, delivery: Delivery) -> None:
        calls[job_id(message)] += 1
        if job_id(message) == "invalid":
            raise InvalidArgument("job_id is invalid", field="job_id")
        if calls[job_id(message)] == 1:
            raise Unavailable("redis away for a moment")

    buses["services"].serve(queue, handler, ABORT)
    invalid = buses["services"].send(queue, site_pb2.AbortRequest(job_id="invalid"))
    buses["services"].send(queue, site_pb2.AbortRequest(job_id="later"))
    [(props, _)] = wait_for(lambda: broker.drain(Names.dead_letter_queue(queue)),
                            what="the dead letter")
    assert props.message_id == invalid
    wait_for(lambda: calls["later"] == 2, what="the retried command")
    assert calls["invalid"] == 1  # never retried


def test_malformed_messages_are_dead_lettered_with_their_bytes(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    queue = NAMES.site_queue("a")
    done: list[str] = []
    buses["services"].serve(queue, lambda m, d: done.append(job_id(m)), ABORT)
    garbage = b"\xff\xff\xff\x00not protobuf"
    for message_id, type_name, body in [
        ("bad-body", "fedhive.v1.AbortRequest", garbage),
        ("no-type", None, site_pb2.AbortRequest(job_id="x").SerializeToString()),
        ("wrong-type", "fedhive.v1.DeployRequest", b"\x0a\x01x"),
    ]:
        props = properties(site_pb2.AbortRequest, message_id=message_id)
        props.type, props.content_type = type_name, CONTENT_TYPE
        assert broker.publish("services", NAMES.cmd_exchange, queue, body, props)
    buses["services"].send(queue, site_pb2.AbortRequest(job_id="fine"))
    letters: list[tuple[pika.BasicProperties, bytes]] = []

    def all_in() -> bool:
        letters.extend(broker.drain(Names.dead_letter_queue(queue)))
        return len(letters) == 3

    wait_for(all_in, what="three dead letters")
    assert {props.message_id: body for props, body in letters} == {
        "bad-body": garbage,
        "no-type": site_pb2.AbortRequest(job_id="x").SerializeToString(),
        "wrong-type": b"\x0a\x01x",
    }
    wait_for(lambda: done == ["fine"], what="the well-formed message")


def test_expired_rpc_request_is_not_served_late(buses: dict[str, MemoryBus]) -> None:
    bus = buses["services"]
    queue = NAMES.site_queue("late")
    bus.declare_queue(queue)
    with pytest.raises(RpcTimeout):
        bus.call(queue, site_pb2.CheckResourcesRequest(job_id="stale"),
                 site_pb2.CheckResourcesReply, timeout=0.2)
    served: list[str] = []

    def handler(message: Message, delivery: Delivery) -> Message:
        served.append(job_id(message))
        return site_pb2.CheckResourcesReply(ok=True)

    bus.serve(queue, handler, [site_pb2.CheckResourcesRequest])
    assert bus.call(queue, site_pb2.CheckResourcesRequest(job_id="fresh"),
                    site_pb2.CheckResourcesReply, timeout=10).ok
    assert served == ["fresh"]


def test_handlers_run_concurrently_up_to_the_concurrency(buses: dict[str, MemoryBus]) -> None:
    queue = NAMES.site_queue("a")
    together = threading.Barrier(3, timeout=10)  # broken unless three handlers run at once
    done: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        together.wait()
        done.append(job_id(message))

    buses["services"].serve(queue, handler, ABORT, concurrency=3)
    for i in range(3):
        buses["services"].send(queue, site_pb2.AbortRequest(job_id=str(i)))
    wait_for(lambda: len(done) == 3, what="three handlers at once")
    assert not together.broken


def test_batches_gather_events_and_a_failed_batch_is_redelivered(
    buses: dict[str, MemoryBus]
) -> None:
    batches: list[list[tuple[str, int]]] = []
    fail = threading.Event()
    fail.set()

    def handle_batch(batch: list[tuple[Message, Delivery]]) -> None:
        batches.append([(site_of(m), d.delivery_count) for m, d in batch])
        if fail.is_set():
            fail.clear()
            raise RuntimeError("store away")

    services = buses["services"]
    services.subscribe_batches("intake", ["site.*.heartbeat"], handle_batch,
                               [site_pb2.SiteHeartbeat], senders=Senders.any_site(NAMES),
                               max_batch=2, max_wait_s=30)  # a batch: both sites' beats
    for site in "ab":
        buses[site].publish_event(NAMES.site_event(site, "heartbeat"),
                                  site_pb2.SiteHeartbeat(site=site))
    services.publish_event(NAMES.site_event("a", "heartbeat"),  # not a site: refused
                           site_pb2.SiteHeartbeat(site="forged"))
    buses["a"].publish_event(NAMES.site_event("a", "online"), site_pb2.SiteHeartbeat(site="a"))
    wait_for(lambda: any(count for batch in batches for _, count in batch),
             what="the failed batch again")
    handled = [beat for batch in batches[1:] for beat in batch]
    assert sorted(handled) == [("a", 1), ("b", 1)]
    assert all(site != "forged" for batch in batches for site, _ in batch)


def site_of(message: Message) -> str:
    assert isinstance(message, site_pb2.SiteHeartbeat)
    return message.site


def test_stop_lets_the_running_handler_finish_and_close_stops_everything(
    broker: MemoryBroker, buses: dict[str, MemoryBus]
) -> None:
    bus = buses["services"]
    queue = NAMES.site_queue("stop")
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def handler(message: Message, delivery: Delivery) -> None:
        started.set()
        release.wait(30)
        finished.append(job_id(message))

    events = bus.subscribe("watcher", ["#"], lambda m, d: None, ABORT)  # stopped first
    consumer = bus.serve(queue, handler, ABORT)
    assert consumer.consuming_since is not None and events.consuming_since is not None
    bus.send(queue, site_pb2.AbortRequest(job_id="long"))
    assert started.wait(10)
    closer = threading.Thread(target=bus.close)
    closer.start()
    wait_for(lambda: events.consuming_since is None, what="the other subscription to stop")
    assert closer.is_alive() and consumer.consuming_since is not None  # waits for the handler
    release.set()
    closer.join(10)
    assert not closer.is_alive() and finished == ["long"]
    assert consumer.consuming_since is None and broker.drain(queue) == []  # settled
    with pytest.raises(Unavailable):
        bus.send(queue, site_pb2.AbortRequest(job_id="after"))
    result = bus.call_many({queue: site_pb2.AbortRequest()}, common_pb2.Ack, timeout=1)
    assert isinstance(result[queue], Unavailable)
