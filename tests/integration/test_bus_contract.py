"""The bus port's contract: every implementation (the `bus` fixture) must pass this suite."""

from __future__ import annotations

import threading

import pytest
from google.protobuf.message import Message

from fedhive.bus import Bus, Delivery, Encoded, Pending, RabbitBus
from fedhive.bus.codec import HEAD_MAX
from fedhive.errors import FedhiveError, NotFound, RpcTimeout, Unroutable
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, job_pb2, site_pb2
from tests.fixtures.bus import job_id
from tests.fixtures.infra import wait_for

CHECK = [site_pb2.CheckResourcesRequest]


def reserve(message: Message, delivery: Delivery) -> site_pb2.CheckResourcesReply:
    assert isinstance(message, site_pb2.CheckResourcesRequest)
    return site_pb2.CheckResourcesReply(ok=True, token=f"tok-{message.job_id}")


def test_rpc_round_trip(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).site_queue("a")
    seen: list[Delivery] = []

    def handler(message: Message, delivery: Delivery) -> Message:
        seen.append(delivery)
        return reserve(message, delivery)

    bus.serve(queue, handler, CHECK)
    reply = bus.call(queue, site_pb2.CheckResourcesRequest(job_id="j1"),
                     site_pb2.CheckResourcesReply, timeout=10)
    assert reply == site_pb2.CheckResourcesReply(ok=True, token="tok-j1")
    assert seen[0].type_name == "fedhive.v1.CheckResourcesRequest"
    assert seen[0].message_id and len(seen[0].message_id) == 32
    assert seen[0].queue == queue and seen[0].correlation_id


def test_rpc_handler_returning_none_replies_ack(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).service_queue("job-runner")
    bus.serve(queue, lambda message, delivery: None, [site_pb2.FreeResourcesRequest])
    reply = bus.call(queue, site_pb2.FreeResourcesRequest(job_id="j"), common_pb2.Ack, timeout=10)
    assert reply == common_pb2.Ack()


def test_rpc_timeout_names_queue_and_timeout(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).site_queue("silent")
    bus.declare_queue(queue)  # routable, but nobody serves it
    with pytest.raises(RpcTimeout) as caught:
        bus.call(queue, site_pb2.CheckResourcesRequest(job_id="j"),
                 site_pb2.CheckResourcesReply, timeout=0.5)
    assert queue in str(caught.value) and "0.5" in str(caught.value)
    assert caught.value.field == queue


def test_typed_error_reply_is_raised_on_the_client(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).service_queue("job-store")

    def handler(message: Message, delivery: Delivery) -> Message:
        raise NotFound("job 'j9' does not exist", field="job_id")

    bus.serve(queue, handler, CHECK)
    with pytest.raises(NotFound) as caught:
        bus.call(queue, site_pb2.CheckResourcesRequest(job_id="j9"),
                 site_pb2.CheckResourcesReply, timeout=10)
    assert str(caught.value) == "job 'j9' does not exist"
    assert caught.value.field == "job_id"
    # the consumer is still serving after a domain error
    bus.serve(Names(namespace).site_queue("ok"), reserve, CHECK)
    assert bus.call(Names(namespace).site_queue("ok"), site_pb2.CheckResourcesRequest(job_id="x"),
                    site_pb2.CheckResourcesReply, timeout=10).ok


def test_parallel_calls_with_slow_and_absent_targets(bus: Bus, namespace: str) -> None:
    names = Names(namespace)
    fast, slow, absent = (names.site_queue(site) for site in ("fast", "slow", "gone"))
    release = threading.Event()

    def stuck(message: Message, delivery: Delivery) -> Message:
        release.wait(30)
        return reserve(message, delivery)

    bus.serve(fast, reserve, CHECK)
    bus.serve(slow, stuck, CHECK)
    try:
        requests = {q: site_pb2.CheckResourcesRequest(job_id="j") for q in (fast, slow, absent)}
        results = bus.call_many(requests, site_pb2.CheckResourcesReply, timeout=1.0)
    finally:
        release.set()
    assert results[fast] == site_pb2.CheckResourcesReply(ok=True, token="tok-j")
    assert isinstance(results[slow], RpcTimeout) and slow in str(results[slow])
    assert isinstance(results[absent], Unroutable) and absent in str(results[absent])


def test_concurrent_callers_each_get_their_own_reply(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).site_queue("busy")
    bus.serve(queue, reserve, CHECK, concurrency=4)
    replies: dict[int, str] = {}

    def caller(i: int) -> None:
        replies[i] = bus.call(queue, site_pb2.CheckResourcesRequest(job_id=str(i)),
                              site_pb2.CheckResourcesReply, timeout=20).token

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies == {i: f"tok-{i}" for i in range(8)}


def test_a_handler_may_answer_later_from_another_thread(bus: Bus, namespace: str) -> None:
    """One handler thread parks three requests (a `Pending` each: the thread is free for the
    next), then another thread answers them in reverse order, each once; a `Pending` completed
    before the handler returns it is answered as well."""
    queue = Names(namespace).site_queue("later")
    parked: dict[str, Pending] = {}
    lock = threading.Lock()

    def handler(message: Message, delivery: Delivery) -> Pending:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        pending = Pending()
        if message.job_id == "now":
            pending.complete(site_pb2.CheckResourcesReply(ok=True, token="at once"))
        with lock:
            parked[message.job_id] = pending
        return pending

    bus.serve(queue, handler, CHECK, prefetch=4, concurrency=1)  # parked ones stay unacked
    replies: dict[str, str] = {}

    def caller(job: str) -> None:
        replies[job] = bus.call(queue, site_pb2.CheckResourcesRequest(job_id=job),
                                site_pb2.CheckResourcesReply, timeout=20).token

    threads = [threading.Thread(target=caller, args=(job,)) for job in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(parked) == 3, timeout=10, what="three requests parked")
    assert replies == {}
    for job in ("c", "b", "a"):
        parked[job].complete(site_pb2.CheckResourcesReply(ok=True, token=f"late-{job}"))
        parked[job].complete(site_pb2.CheckResourcesReply(ok=True, token="twice"))
    for thread in threads:
        thread.join()
    assert replies == {"a": "late-a", "b": "late-b", "c": "late-c"}
    caller("now")
    assert replies["now"] == "at once"


def test_a_queue_is_reached_by_each_of_its_many_binding_keys(bus: Bus, namespace: str) -> None:
    """As a job's task queue for hundreds of sites (RabbitBus binds them without waiting for
    each, the last bind confirming all: `Topology.declare_queue`)."""
    names = Names(namespace)
    queue = names.job_server_queue("many")
    keys = [names.job_site_route("many", f"s{i}") for i in range(200)]
    bus.serve(queue, reserve, CHECK, binding_keys=keys)
    for target in (queue, keys[0], keys[117], keys[-1]):
        reply = bus.call(target, site_pb2.CheckResourcesRequest(job_id=target[-4:]),
                         site_pb2.CheckResourcesReply, timeout=10)
        assert reply.token == f"tok-{target[-4:]}"
    with pytest.raises(Unroutable):
        bus.call(names.job_site_route("many", "s200"), site_pb2.CheckResourcesRequest(),
                 site_pb2.CheckResourcesReply, timeout=10)


def test_unroutable_publish_raises(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).site_queue("nobody")
    with pytest.raises(Unroutable) as caught:
        bus.send(queue, site_pb2.AbortRequest(job_id="j"))
    assert queue in str(caught.value) and f"{namespace}.cmd" in str(caught.value)


def test_event_without_subscribers_is_not_an_error(bus: Bus) -> None:
    assert len(bus.publish_event("job.status.RUNNING", job_pb2.JobStatusEvent())) == 32


def test_commands_carry_message_id_and_are_acked_after_the_handler(
    bus: Bus, namespace: str
) -> None:
    queue = Names(namespace).site_queue("cmd")
    got: list[tuple[str, str | None]] = []
    bus.serve(queue, lambda m, d: got.append((job_id(m), d.message_id)), [site_pb2.AbortRequest])
    given = bus.send(queue, site_pb2.AbortRequest(job_id="j1"), message_id="idem-1")
    generated = bus.send(queue, site_pb2.AbortRequest(job_id="j2"))
    assert given == "idem-1" and len(generated) == 32
    wait_for(lambda: len(got) == 2, what="both commands handled")
    assert sorted(got) == [("j1", "idem-1"), ("j2", generated)]


def test_event_subscription_with_topic_patterns(bus: Bus, namespace: str) -> None:
    got: list[tuple[str, str]] = []

    def handler(message: Message, delivery: Delivery) -> None:
        got.append((delivery.routing_key, delivery.type_name))

    bus.subscribe("watcher", ["job.status.*", "site.#"], handler,
                  [job_pb2.JobStatusEvent, site_pb2.SiteHeartbeat])
    bus.publish_event("job.status.RUNNING", job_pb2.JobStatusEvent(job_id="j"))
    bus.publish_event("site.online", site_pb2.SiteHeartbeat(site="a"))
    bus.publish_event("site.heartbeat.a", site_pb2.SiteHeartbeat(site="a"))
    # `job.status.*` matches one word only: this one is dropped. The sentinel after it arrives
    # last on the same queue, so once it is in, the dropped event would have been too.
    bus.publish_event("job.status.FINISHED.COMPLETED", job_pb2.JobStatusEvent(job_id="j"))
    bus.publish_event("job.status.FINISHED:COMPLETED", job_pb2.JobStatusEvent(job_id="j"))
    wait_for(lambda: len(got) == 4, what="four matching events")
    assert sorted(got) == [
        ("job.status.FINISHED:COMPLETED", "fedhive.v1.JobStatusEvent"),
        ("job.status.RUNNING", "fedhive.v1.JobStatusEvent"),
        ("site.heartbeat.a", "fedhive.v1.SiteHeartbeat"),
        ("site.online", "fedhive.v1.SiteHeartbeat"),
    ]


def test_declaring_twice_is_a_no_op(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).service_queue("scheduler")
    bus.declare_queue(queue)
    bus.declare_queue(queue)
    got: list[str] = []
    bus.serve(queue, lambda m, d: got.append(job_id(m)), [site_pb2.AbortRequest])  # declares again
    bus.send(queue, site_pb2.AbortRequest(job_id="j"))
    wait_for(lambda: got == ["j"], what="the command on the twice-declared queue")


def test_a_deleted_queue_takes_its_dead_letters_along(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).job_server_queue("gone")
    bus.declare_queue(queue)
    bus.send(queue, site_pb2.AbortRequest(job_id="j"))  # left unconsumed: dropped with it
    bus.delete_queue(queue)
    bus.delete_queue(queue)  # a missing queue is not an error
    with pytest.raises(Unroutable):
        bus.send(queue, site_pb2.AbortRequest(job_id="j"))


def test_errors_cross_as_fedhive_errors(bus: Bus, namespace: str) -> None:
    queue = Names(namespace).site_queue("err")

    def handler(message: Message, delivery: Delivery) -> Message:
        raise FedhiveError("plain failure")

    bus.serve(queue, handler, CHECK)
    with pytest.raises(FedhiveError, match="plain failure") as caught:
        bus.call(queue, site_pb2.CheckResourcesRequest(), site_pb2.CheckResourcesReply, timeout=10)
    assert type(caught.value) is FedhiveError


def test_quick_messages_are_answered_refused_and_parked_like_the_rest(
    bus: Bus, namespace: str
) -> None:
    """The messages a consumer's `quick` predicate picks (handled on the connection thread of a
    transport that has one, not handed to a handler thread) get every outcome the others get:
    a reply, a typed error, a reply given later from another thread."""
    queue = Names(namespace).site_queue("quick")
    threads: dict[str, str] = {}
    parked: list[Pending] = []

    def handler(message: Message, delivery: Delivery) -> Message | Pending:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        threads[message.job_id] = threading.current_thread().name
        if message.job_id.endswith("missing"):
            raise NotFound(f"no job {message.job_id}", field="job_id")
        if message.job_id.endswith("later"):
            pending = Pending()
            parked.append(pending)
            return pending
        return reserve(message, delivery)

    bus.serve(queue, handler, CHECK, prefetch=4, concurrency=2,
              quick=lambda message: message.job_id.startswith("q-"))

    def call(job: str) -> str:
        return bus.call(queue, site_pb2.CheckResourcesRequest(job_id=job),
                        site_pb2.CheckResourcesReply, timeout=10).token

    assert call("q-1") == "tok-q-1" and call("slow") == "tok-slow"
    with pytest.raises(NotFound, match="no job q-missing"):
        call("q-missing")
    later: dict[str, str] = {}
    caller = threading.Thread(target=lambda: later.update(token=call("q-later")))
    caller.start()
    wait_for(lambda: parked, timeout=10, what="the quick request parked")
    parked[0].complete(site_pb2.CheckResourcesReply(ok=True, token="given later"))
    caller.join(timeout=10)
    assert later == {"token": "given later"}
    if isinstance(bus, RabbitBus):  # it has an I/O thread: quick ones stay on it
        assert threads["q-1"].startswith("bus-consumer-")
        assert threads["q-later"].startswith("bus-consumer-")
        assert threads["slow"].startswith("bus-handler-")


def test_an_encoded_reply_reaches_its_caller_with_its_head_merged(
    bus: Bus, namespace: str
) -> None:
    """A body shared by many callers goes out as it is, each caller's own part beside it (in a
    header up to HEAD_MAX, which the broker takes; joined to the body past it)."""
    queue = Names(namespace).site_queue("encoded")
    shared = site_pb2.CheckResourcesReply(ok=True).SerializeToString()

    def handler(message: Message, delivery: Delivery) -> Encoded:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        own = site_pb2.CheckResourcesReply(token=f"tok-{message.job_id}")
        return Encoded(site_pb2.CheckResourcesReply, shared, own.SerializeToString())

    bus.serve(queue, handler, CHECK)
    for job in ("j1", "j2", "h" * (HEAD_MAX - 16), "h" * (2 * HEAD_MAX)):
        reply = bus.call(queue, site_pb2.CheckResourcesRequest(job_id=job),
                         site_pb2.CheckResourcesReply, timeout=10)
        assert reply == site_pb2.CheckResourcesReply(ok=True, token=f"tok-{job}")


@pytest.mark.parametrize("body", [0, 3, 131_063, 131_064, 131_065, 3 * 131_064 + 7])
def test_messages_cross_intact_whatever_their_size(bus: Bus, namespace: str, body: int) -> None:
    """Requests and replies of every size, around RabbitMQ's frame (131,064 bytes of body each)
    included, arrive byte for byte (fedhive cuts bodies into frames itself: bus/pika_io.py)."""
    queue = Names(namespace).site_queue("sizes")
    length = max(body - (4 if body > 16_386 else 2), 0)  # less the field's tag and length
    text = "".join(chr(ord("a") + i % 26) for i in range(length))
    assert len(site_pb2.CheckResourcesRequest(job_id=text).SerializeToString()) == body

    def echo(message: Message, delivery: Delivery) -> site_pb2.CheckResourcesReply:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        return site_pb2.CheckResourcesReply(token=message.job_id[::-1])

    bus.serve(queue, echo, CHECK)
    reply = bus.call(queue, site_pb2.CheckResourcesRequest(job_id=text),
                     site_pb2.CheckResourcesReply, timeout=20)
    assert reply.token == text[::-1]


def test_attachments_reach_the_handler_and_the_caller(bus: Bus, namespace: str) -> None:
    """An `Encoded` message's attachment arrives after its message: a request's as
    `Delivery.attachment`, a reply's from `call_attached` (views of the body received: what
    attached refs name); a plain message has none."""
    queue = Names(namespace).site_queue("attached")
    seen: list[bytes] = []
    big = bytes(range(256)) * 1024  # past a frame

    def handler(message: Message, delivery: Delivery) -> Encoded:
        assert isinstance(message, site_pb2.CheckResourcesRequest)
        seen.append(bytes(delivery.attachment))
        reply = site_pb2.CheckResourcesReply(token=message.job_id).SerializeToString()
        return Encoded.attaching(site_pb2.CheckResourcesReply, reply, [big[::-1]])

    bus.serve(queue, handler, CHECK)
    request = site_pb2.CheckResourcesRequest(job_id="j1")
    reply, attached = bus.call_attached(
        queue, Encoded.attaching(site_pb2.CheckResourcesRequest, request.SerializeToString(),
                                 [b"abc", memoryview(big)]),
        site_pb2.CheckResourcesReply, timeout=10)
    assert reply.token == "j1" and attached == big[::-1]
    assert bus.call(queue, request, site_pb2.CheckResourcesReply, timeout=10).token == "j1"
    assert seen == [b"abc" + big, b""]
