"""Bad input is bounded before it is stored (issue 16, point 5), on real Redis, S3 and broker:
the job-store's handlers, the job-store as a process, and the real gateway in front of it.

Every refusal is one line of bounded length, and leaves no record, no definition and no staged
upload behind. Records stored before the limits existed (or written around them) never break a
listing, `job` or `delete`. (The rules themselves: tests/unit/test_jobs_limits.py.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import FedhiveError, InvalidArgument
from fedhive.jobs.archive import MiB
from fedhive.jobs.limits import MAX_META_BYTES
from fedhive.jobs.record import JobMeta, Submitter
from fedhive.jobs.serde import record_from_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.state import RedisStateStore
from fedhive.state.rounds import RoundLog
from fedhive_services.job_store.replies import MAX_LIST_BYTES, TRIMMED
from tests.fixtures.bus import Broker
from tests.fixtures.gateway import GatewayProcess, GatewayStack, write_admins
from tests.fixtures.job_store import JobStoreProcess, stage
from tests.fixtures.job_store_handlers import ALICE, NoRunner, Store, handler_store
from tests.unit.test_jobs_limits import ALL, job_zip, nested, noise

MAX_MESSAGE = 8 * 1024  # no refusal message may be longer, whatever the input held

BAD_JOBS: dict[str, Callable[[], bytes]] = {
    "min_clients_1e30": lambda: job_zip({**ALL, "min_clients": 10**30}),
    "meta_field_20_mib": lambda: job_zip({**ALL, "notes": noise(20 * MiB)}),
    "meta_nested_1000": lambda: job_zip(
        f'{{"name": "j", "deploy_map": {{"all": ["@ALL"]}}, "x": {nested(1000)}}}'
    ),
    "config_nested_1000": lambda: job_zip(
        ALL, {"all/config/config_fed_client.json": f'{{"x": {nested(1000)}}}'.encode()}
    ),
    "huge_names": lambda: job_zip(
        {**ALL, "deploy_map": {"all": ["@ALL"], noise(MAX_META_BYTES // 2): ["x" * 99]}}
    ),
}


@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog
          ) -> Iterator[Store]:
    yield handler_store(redis_state, job_store_blobs, round_log, NoRunner())


def _nothing_stored(store: Store) -> None:
    assert store.state.recent_job_ids() == []
    assert store.objects(f"{store.names.ns}/") == []  # no definition, no staged upload


# the job-store's handlers -------------------------------------------------------------------
@pytest.mark.parametrize("make", BAD_JOBS.values(), ids=BAD_JOBS.keys())
def test_a_refused_submission_stores_nothing(store: Store, make: Callable[[], bytes]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        store.submit(make(), submission_id="run-1")
    message = str(caught.value)
    assert "\n" not in message and len(message) <= MAX_MESSAGE
    _nothing_stored(store)


def test_every_refusal_path_deletes_the_staged_upload(store: Store) -> None:
    requests = [
        jobstore_pb2.StoreSubmitJob(submitter=ALICE, submission_id="bad id!"),
        jobstore_pb2.StoreSubmitJob(submitter=job_pb2.Submitter(name=" ")),
    ]
    for request in requests:
        request.staging_key = stage(store.blobs, store.names, job_zip(ALL))
        with pytest.raises(InvalidArgument):
            store.call(request)
    mandatory = job_zip({**ALL, "mandatory_clients": ["never-seen"]})  # can never run
    with pytest.raises(InvalidArgument, match="can never run"):
        store.submit(mandatory)
    _nothing_stored(store)


def test_records_stored_before_the_limits_do_not_break_list_get_or_delete(store: Store) -> None:
    """A record the job-store can no longer be asked to store (written here through the state
    port, as an older version or another writer could) is listed and shown trimmed."""
    bad = {
        "min_clients": JobMeta("int32-overflow", deploy_map={"all": ["@ALL"]},
                               min_clients=10**30),
        "huge": JobMeta("huge", extra={"notes": noise(5 * MiB)}),
        "deep": JobMeta("deep", extra={"x": _nested_dict(40)}),
    }
    good = [store.state.create_job(str(uuid.uuid4()), JobMeta(f"good-{n}"), Submitter("alice"))
            for n in range(3)]
    bad_ids = {what: store.state.create_job(str(uuid.uuid4()), meta, Submitter("alice")).job_id
               for what, meta in bad.items()}
    listed = store.call(admin_pb2.ListJobsRequest())
    assert isinstance(listed, admin_pb2.ListJobsReply)
    assert listed.ByteSize() <= MAX_LIST_BYTES
    records = {r.job_id: r for r in map(record_from_proto, listed.jobs)}
    assert set(records) == {r.job_id for r in good} | set(bad_ids.values())
    assert all(TRIMMED not in records[r.job_id].meta.extra for r in good)
    for what, job_id in bad_ids.items():
        record = records[job_id]
        assert record.meta.name == bad[what].name and TRIMMED in record.meta.extra, what
        shown = store.call(admin_pb2.GetJobRequest(job_id=job_id))
        assert isinstance(shown, job_pb2.JobRecord)
        assert TRIMMED in record_from_proto(shown).meta.extra
        store.move_to(job_id, JobStatus.FINISHED_ABORTED)
        store.call(admin_pb2.DeleteJobRequest(job_id=job_id))
    assert set(store.state.recent_job_ids()) == {r.job_id for r in good}


def test_a_list_reply_stays_under_the_grpc_limit(store: Store) -> None:
    ids = [store.state.create_job(str(uuid.uuid4()), JobMeta(f"j{n}", extra={"n": noise(60_000)}),
                                  Submitter("alice")).job_id
           for n in range(100)]  # 6 MB of records, each one within meta.json's limit
    listed = store.call(admin_pb2.ListJobsRequest(limit=100))
    assert isinstance(listed, admin_pb2.ListJobsReply)
    assert listed.ByteSize() <= MAX_LIST_BYTES
    assert 50 <= len(listed.jobs) < 100
    assert [job.job_id for job in listed.jobs] == ids[::-1][:len(listed.jobs)]  # newest first


@pytest.mark.parametrize(("request_", "field"), [
    (admin_pb2.GetJobRequest(job_id="j" * 10_000), "job_id"),
    (admin_pb2.AbortJobRequest(job_id=str(uuid.uuid4()), reason="r" * 10_000), "reason"),
    (admin_pb2.ListJobsRequest(name="n" * 10_000), "name"),
    (admin_pb2.ListJobsRequest(limit=20_000), "limit"),
])
def test_request_fields_are_bounded(store: Store, request_: Message, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        store.call(request_)
    assert caught.value.field == field and len(str(caught.value)) < 300


def test_a_request_the_job_store_cannot_handle_is_answered_at_once(
    store: Store, settings: Settings, job_store_process: JobStoreProcess,
    job_store_client: RabbitBus,
) -> None:
    """A record whose meta nests past the interpreter's recursion limit (written straight to
    Redis): the job-store answers an error instead of failing the request until it is
    dead-lettered while the caller waits for its timeout."""
    job_id = store.state.create_job(str(uuid.uuid4()), JobMeta("j"), Submitter("alice")).job_id
    client = redis.Redis.from_url(settings.redis_url)
    client.hset(Names(settings.namespace).job_key(job_id), "meta", nested(100_000))
    client.close()
    request = admin_pb2.GetJobRequest(job_id=job_id)
    with pytest.raises(FedhiveError, match="could not handle GetJobRequest: RecursionError"):
        store.call(request)
    with pytest.raises(FedhiveError, match="could not handle GetJobRequest") as caught:
        job_store_client.call(job_store_process.queue, request, job_pb2.JobRecord, timeout=60)
    assert caught.value.code == "INTERNAL"


def _nested_dict(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value


# the real gateway ---------------------------------------------------------------------------
def _staged(settings: Settings) -> list[str]:
    blobs = S3BlobStore.from_settings(settings)
    try:
        prefix = Names(settings.namespace).staging_key("")[: -len(".zip")]
        listed = blobs._client.list_objects_v2(Bucket=blobs.bucket, Prefix=prefix)
        return [item["Key"] for item in listed.get("Contents", [])]
    finally:
        blobs.close()


@pytest.mark.parametrize("make", BAD_JOBS.values(), ids=BAD_JOBS.keys())
def test_the_gateway_answers_a_bad_job_in_one_line_and_keeps_nothing(
    gateway_stack: GatewayStack, make: Callable[[], bytes]
) -> None:
    gateway = gateway_stack.gateway
    with gateway.session("admin@a") as session:
        before = len(session.list(limit=1000))
        data = make()  # sent past the SDK's own checks, in chunks as the SDK sends them
        chunks = (admin_pb2.SubmitJobChunk(data=data[i:i + MiB]) for i in range(0, len(data), MiB))
        with pytest.raises(grpc.RpcError) as caught:
            session._stub.SubmitJob(chunks, metadata=session._metadata, timeout=60)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = caught.value.details()
        assert "\n" not in details and len(details) <= MAX_MESSAGE
        assert len(session.list(limit=1000)) == before
    assert _staged(gateway_stack.settings) == []


def test_the_gateway_refuses_a_bad_submission_id_before_staging(
    gateway_stack: GatewayStack,
) -> None:
    gateway = gateway_stack.gateway
    with gateway.session("admin@a") as session:
        chunk = admin_pb2.SubmitJobChunk(data=job_zip(ALL), submission_id="x" * 10_000)
        with pytest.raises(grpc.RpcError) as caught:
            session._stub.SubmitJob(iter([chunk]), metadata=session._metadata, timeout=60)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "... (10000 characters) must be 1-128 characters" in caught.value.details()
        with pytest.raises(InvalidArgument, match="reason"):
            session.abort(str(uuid.uuid4()), reason="r" * 10_000)
        with pytest.raises(InvalidArgument, match="job_id"):
            session.get("j" * 10_000)
    assert _staged(gateway_stack.settings) == []


def test_the_gateway_deletes_the_upload_when_the_job_store_does_not_answer(
    settings: Settings, tmp_path: Path, broker: Broker,
) -> None:
    """No job-store ever ran in this namespace: the submit fails at once (no queue), and the
    gateway, not the job-store, must delete what it staged (`broker` deletes the exchanges the
    gateway declared)."""
    service = GatewayProcess(settings, write_admins(tmp_path / "admins.json"),
                             tmp_path / "gateway.log")
    service.start()
    try:
        service.wait_ready()
        with service.session("admin@a") as session:
            chunk = admin_pb2.SubmitJobChunk(data=job_zip(ALL))
            with pytest.raises(grpc.RpcError) as caught:
                session._stub.SubmitJob(iter([chunk]), metadata=session._metadata, timeout=60)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop()
    assert _staged(settings) == []
