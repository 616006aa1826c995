"""Shared job logs on real Redis and RabbitMQ: the store (each line once, whatever the order or
repetition of batches; capped; gone with the job), the job-store's page of lines, and the
job-runner's intake with raw site clients: a site writes only its own lines, of its own jobs."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pika
import pika.exceptions
import pytest
import redis

from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.bus.publisher import properties
from fedhive.config import Settings
from fedhive.errors import InvalidArgument
from fedhive.joblogs.lines import Line
from fedhive.joblogs.tail import Batch, Position
from fedhive.joblogs.wire import CLIENT_JOB, SERVER, batch_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, site_pb2
from fedhive.state import RedisStateStore
from fedhive.state.joblogs import DONE, PRIVATE, JobLogStore
from fedhive.state.port import JobUpdate
from fedhive.state.rounds import RoundLog
from fedhive_services.job_runner.logs import LogIntake
from tests.fixtures.bus import Broker
from tests.fixtures.infra import wait_for
from tests.fixtures.job_store import job_zip
from tests.fixtures.job_store_handlers import NoRunner, Store, handler_store
from tests.fixtures.state import submit, submit_in


@pytest.fixture
def logs(settings: Settings) -> Iterator[JobLogStore]:
    store = JobLogStore.from_settings(settings)
    yield store
    store.close()


def lines(*ends: int, error_at: int = 0) -> list[Line]:
    return [Line(end, f"line {end}", end == error_at) for end in ends]


def texts(logs: JobLogStore, job_id: str, **options: Any) -> list[str]:
    return [entry.line for entry in logs.read(job_id, **options).lines]


# the store ----------------------------------------------------------------------------------
def test_each_line_is_stored_once_whatever_the_order_of_batches(
    redis_state: RedisStateStore, logs: JobLogStore,
) -> None:
    submit(redis_state, "j1")
    assert logs.append("j1", "a", CLIENT_JOB, 8, lines(12, 16)) == 2  # arrived first
    assert logs.append("j1", "a", CLIENT_JOB, 0, lines(4, 8)) == 2  # the batch before it
    assert logs.append("j1", "a", CLIENT_JOB, 8, lines(12, 16)) == 0  # redelivered
    # a restarted agent sends again from its last saved position, with what came since
    assert logs.append("j1", "a", CLIENT_JOB, 0, lines(4, 8, 12, 16, 20)) == 1
    assert logs.append("j1", "b", CLIENT_JOB, 0, lines(4)) == 1  # another site's own bytes
    assert texts(logs, "j1") == ["line 12", "line 16", "line 4", "line 8", "line 20", "line 4"]
    assert [e.site for e in logs.read("j1").lines] == ["a"] * 5 + ["b"]
    assert logs.stored_up_to("j1", "a") == 20 and logs.stored_up_to("j1", "c") == 0


def test_the_last_stored_error_is_the_sites_last_error(
    redis_state: RedisStateStore, logs: JobLogStore,
) -> None:
    submit(redis_state, "j1")
    logs.append("j1", "a", CLIENT_JOB, 0, lines(4, 8, error_at=4))
    logs.append("j1", SERVER, SERVER, 0,
                [Line(30, '{"event": "sj.failed", "level": "error", "error": "bad"}', True)])
    assert logs.last_errors("j1") == {"a": "line 4", SERVER: "sj.failed: bad"}
    logs.append("j1", "a", CLIENT_JOB, 0, [Line(4, "line 4 again", True), Line(12, "x")])
    assert logs.last_errors("j1")["a"] == "line 4"  # a repeated line changes nothing


def test_nothing_is_written_for_a_job_that_does_not_exist_or_was_deleted(
    redis_state: RedisStateStore, logs: JobLogStore, settings: Settings,
) -> None:
    names = Names(settings.namespace)
    assert logs.append("nope", "a", CLIENT_JOB, 0, lines(4, error_at=4), eof=True) is None
    assert not logs.mark("nope", "a", PRIVATE)
    submit_in(redis_state, "j1", JobStatus.FINISHED_COMPLETED)
    logs.append("j1", "a", CLIENT_JOB, 0, lines(4, error_at=4), eof=True)
    logs.mark("j1", "b", PRIVATE)
    assert logs.sites("j1") == {"a": DONE, "b": PRIVATE}
    assert redis_state.delete_job("j1")
    logs.append("j1", "a", CLIENT_JOB, 4, lines(8))  # a late batch of the deleted job
    raw = redis.Redis.from_url(settings.redis_url)
    try:
        keys = [*names.job_log_keys("j1"), *names.job_log_keys("nope")]
        assert raw.exists(*keys) == 0
    finally:
        raw.close()


def test_the_stream_is_capped(redis_state: RedisStateStore, settings: Settings) -> None:
    submit(redis_state, "j1")
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    store = JobLogStore(client, Names(settings.namespace), max_lines=100)
    try:
        for start in range(0, 3000, 300):
            store.append("j1", "a", CLIENT_JOB, start, lines(*range(start + 1, start + 301)))
        kept = store.read("j1", limit=500).lines
        assert 100 <= len(kept) < 3000
        assert kept[-1].line == "line 3000"  # the oldest go first
    finally:
        store.close()


def test_reading_pages_after_a_line_and_of_one_site(
    redis_state: RedisStateStore, logs: JobLogStore,
) -> None:
    submit(redis_state, "j1")
    logs.append("j1", "a", CLIENT_JOB, 0, lines(1, 2, 3))
    logs.append("j1", SERVER, SERVER, 0, lines(1, 2))
    first = logs.read("j1", limit=2)
    assert [e.line for e in first.lines] == ["line 1", "line 2"] and first.more
    rest = logs.read("j1", after=first.lines[-1].id)
    assert [(e.site, e.line) for e in rest.lines] == [
        ("a", "line 3"), (SERVER, "line 1"), (SERVER, "line 2")] and not rest.more
    assert [e.source for e in logs.read("j1", site=SERVER).lines] == [SERVER, SERVER]
    assert logs.read("j1", after=rest.lines[-1].id).lines == []
    with pytest.raises(InvalidArgument, match="after"):
        logs.read("j1", after="yesterday")


# the job-store's page -----------------------------------------------------------------------
@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog,
          logs: JobLogStore) -> Store:
    plain = handler_store(redis_state, job_store_blobs, round_log, NoRunner())
    return Store(replace(plain.ctx, logs=logs), plain.events, plain.names)


def page(store: Store, job_id: str, **fields: Any) -> admin_pb2.JobLogPage:
    reply = store.call(admin_pb2.JobLogsRequest(job_id=job_id, **fields))
    assert isinstance(reply, admin_pb2.JobLogPage)
    return reply


def test_a_page_says_whether_the_logs_are_complete(store: Store, logs: JobLogStore) -> None:
    job_id = store.submit(job_zip("logs")).job_id
    assert page(store, job_id) == admin_pb2.JobLogPage(job_id=job_id)
    store.move_to(job_id, JobStatus.RUNNING)
    started = {"deployed": True, "started": True}
    store.state.update_job(job_id, JobUpdate(site_states={"a": started, "b": started}))
    logs.append(job_id, "a", CLIENT_JOB, 0, lines(4, error_at=4), eof=True)
    logs.mark(job_id, "b", PRIVATE)
    shown = page(store, job_id[:8])  # a prefix names the job
    assert shown.job_id == job_id and [line.line for line in shown.lines] == ["line 4"]
    assert list(shown.private_sites) == ["b"] and not shown.final and not shown.complete
    store.state.change_status(job_id, JobStatus.RUNNING,
                              JobStatus.FINISHED_EXECUTION_EXCEPTION, "a site failed")
    assert not page(store, job_id).complete  # the server's last line is not in yet
    logs.append(job_id, SERVER, SERVER, 0, [], eof=True)
    done = page(store, job_id, after=shown.lines[-1].id)
    assert done.final and done.complete and list(done.lines) == []
    record = store.call(admin_pb2.GetJobRequest(job_id=job_id))
    assert isinstance(record, job_pb2.JobRecord)
    assert dict(record.last_errors) == {"a": "line 4"}
    with pytest.raises(InvalidArgument, match="limit"):
        page(store, job_id, limit=-1)


# the runner's intake, with raw site clients ----------------------------------------------------
class Recorded:
    """A logger that keeps what was logged: (event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def bind(self, **fields: Any) -> Recorded:
        return self

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda event, **fields: self.events.append((event, fields))


def test_a_site_writes_only_its_own_lines_of_its_own_jobs(
    settings: Settings, broker: Broker, redis_state: RedisStateStore, logs: JobLogStore,
    site_users: Callable[..., dict[str, Settings]],
) -> None:
    names = Names(settings.namespace)
    a, b = f"{settings.namespace}-a", f"{settings.namespace}-b"
    users = site_users([a, b])
    for job_id, site in (("job-a", a), ("job-b", b)):
        submit_in(redis_state, job_id, JobStatus.RUNNING)
        redis_state.update_job(job_id, JobUpdate(site_states={site: {"deployed": True}}))
    services = RabbitBus(settings, name="runner")
    recorded = Recorded()
    intake = LogIntake(services, redis_state, logs, recorded)
    intake.start()
    connection = pika.BlockingConnection(pika.URLParameters(users[a].amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()

        def publish(routing_key: str, message: site_pb2.LogBatch) -> None:
            channel.basic_publish(names.events_exchange, routing_key,
                                  message.SerializeToString(),
                                  properties(message, user_id=names.site_user(a),
                                             message_id=uuid.uuid4().hex))

        def batch(job_id: str, site: str, text: str) -> site_pb2.LogBatch:
            return batch_to_proto(job_id, site, Batch(0, (Line(9, text, True),), Position(9),
                                                      True), eof=True)

        # a job it is not part of, as itself
        publish(f"site.{a}.logs", batch("job-b", a, "into b's job"))
        # claiming the other site in the body (the routing key is its own)
        publish(f"site.{a}.logs", batch("job-b", b, "as b"))
        # a job that does not exist
        publish(f"site.{a}.logs", batch("job-x", a, "nowhere"))
        # its own job, as itself: stored
        publish(f"site.{a}.logs", batch("job-a", a, "mine"))
        wait_for(lambda: logs.read("job-a").lines, timeout=15, what="site a's own line")
    finally:
        connection.close()
        intake.close()
        services.close()
    assert [(e.site, e.line) for e in logs.read("job-a").lines] == [(a, "mine")]
    assert logs.read("job-b").lines == [] and logs.last_errors("job-b") == {}
    assert logs.sites("job-b") == {} and logs.sites("job-a") == {a: DONE}
    assert logs.last_errors("job-a") == {a: "mine"}
    refused = [fields for event, fields in recorded.events if event == "job_logs_refused"]
    assert [(f["sender"], f["claimed_site"], f["job_id"]) for f in refused] == [
        (names.site_user(a), a, "job-b"), (names.site_user(a), b, "job-b"),
        (names.site_user(a), a, "job-x")]
    assert all(f["security"] for f in refused)


def test_a_site_cannot_publish_on_another_sites_log_key(
    settings: Settings, broker: Broker, site_users: Callable[..., dict[str, Settings]],
) -> None:
    """The broker itself refuses `site.<other>.logs` from a site's user (topic permission)."""
    names = Names(settings.namespace)
    a, b = f"{settings.namespace}-a", f"{settings.namespace}-b"
    users = site_users([a])
    connection = pika.BlockingConnection(pika.URLParameters(users[a].amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        message = site_pb2.LogBatch(job_id="job-b", site=b)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.basic_publish(names.events_exchange, f"site.{b}.logs",
                                  message.SerializeToString(),
                                  properties(message, user_id=names.site_user(a)))
        assert refused.value.reply_code == 403
    finally:
        if connection.is_open:
            connection.close()
