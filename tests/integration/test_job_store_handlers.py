"""The job-store's handlers on real Redis and S3, called the way the bus consumer calls them.

Events go to a recording publisher here; tests/integration/test_job_store_service.py checks
them on the real broker with the service running as a process.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RpcTimeout,
    Unavailable,
)
from fedhive.jobs.definition import load_job
from fedhive.jobs.record import JobMeta, Submitter
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import JobUpdate, RedisStateStore
from fedhive.state.rounds import RoundLog
from fedhive_services.job_store.context import job_id_for
from tests.fixtures.infra import wait_for
from tests.fixtures.job_store import invalid_job_zip, job_zip, stage
from tests.fixtures.job_store_handlers import ALICE, BOB, Store, handler_store

S = JobStatus


@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog
          ) -> Iterator[Store]:
    yield handler_store(redis_state, job_store_blobs, round_log, _RunnerAnswering())


# submit ---------------------------------------------------------------------------------------
def test_submit_stores_definition_record_and_event(store: Store) -> None:
    upload = job_zip("mnist")
    staging = stage(store.blobs, store.names, upload)
    reply = store.call(jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE))
    assert isinstance(reply, admin_pb2.SubmitJobReply) and not reply.existed
    job_id = reply.job_id
    assert uuid.UUID(job_id).version == 4
    record = store.state.get_job(job_id)
    assert record.status == S.SUBMITTED and record.meta.name == "mnist"
    assert record.submitter.name == "alice" and record.submitter.org == "org-a"
    assert record.archive_key == store.names.job_definition_key(job_id)
    stored = store.blobs.get(record.archive_key)
    assert stored == load_job(upload).to_zip()  # the normalised definition
    assert store.events.statuses(job_id) == ["SUBMITTED"]
    assert store.events.published[0][2] == f"{job_id}:1"
    assert not store.blobs.exists(staging)


def test_invalid_job_reports_every_violation_and_stores_nothing(store: Store) -> None:
    staging = stage(store.blobs, store.names, invalid_job_zip())
    with pytest.raises(InvalidArgument) as caught:
        store.call(jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE))
    message = str(caught.value)
    assert "\n" not in message
    assert "min_clients" in message and "site-9" in message and "ghost" in message
    assert store.state.recent_job_ids() == []
    assert store.objects(f"{store.names.ns}/") == []  # staging deleted, no definition
    assert store.events.published == []


def test_unsafe_archive_is_refused_and_staging_deleted(store: Store) -> None:
    staging = stage(store.blobs, store.names, b"this is not a zip")
    with pytest.raises(InvalidArgument, match="not a readable zip"):
        store.call(jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE))
    assert store.objects(f"{store.names.ns}/") == []


@pytest.mark.parametrize(
    ("staging_key", "submitter", "expected"),
    [
        ("elsewhere/x.zip", ALICE, "staging key 'elsewhere/x.zip' is not under"),
        ("{ns}/staging/x.zip", job_pb2.Submitter(), "submitter name is empty"),
        ("{ns}/staging/missing.zip", ALICE, "staged archive .*missing.zip not found"),
    ],
)
def test_bad_submit_requests_are_refused_clearly(
    store: Store, staging_key: str, submitter: job_pb2.Submitter, expected: str
) -> None:
    request = jobstore_pb2.StoreSubmitJob(
        staging_key=staging_key.format(ns=store.names.ns), submitter=submitter
    )
    with pytest.raises((InvalidArgument, NotFound), match=expected):
        store.call(request)
    assert store.state.recent_job_ids() == []


def test_redelivered_submit_makes_no_second_job(store: Store) -> None:
    staging = stage(store.blobs, store.names, job_zip())
    request = jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE)
    first = store.call(request, message_id="m-1")
    again = store.call(request, message_id="m-1", redelivered=True)
    assert isinstance(first, admin_pb2.SubmitJobReply)
    assert isinstance(again, admin_pb2.SubmitJobReply)
    assert first.job_id == again.job_id == job_id_for(store.names.ns, "m-1")
    assert store.state.recent_job_ids() == [first.job_id]


def test_crash_before_the_event_is_finished_by_the_redelivery(store: Store) -> None:
    staging = stage(store.blobs, store.names, job_zip())
    request = jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE)
    store.events.fail_next = True
    with pytest.raises(ConnectionError):
        store.call(request, message_id="m-2")
    job_id = job_id_for(store.names.ns, "m-2")
    assert store.state.get_job(job_id).status == S.SUBMITTED
    assert store.blobs.exists(staging)  # not yet cleaned up: the step after the event
    reply = store.call(request, message_id="m-2", redelivered=True)
    assert isinstance(reply, admin_pb2.SubmitJobReply) and reply.job_id == job_id
    assert store.state.recent_job_ids() == [job_id]
    assert store.events.statuses(job_id) == ["SUBMITTED"]
    assert not store.blobs.exists(staging)


def test_submission_id_same_content_gives_the_same_job(store: Store) -> None:
    first = store.submit(job_zip("a"), submission_id="run-1")
    again = store.submit(job_zip("a"), submission_id="run-1")
    assert again.job_id == first.job_id and again.existed and not first.existed
    assert store.state.recent_job_ids() == [first.job_id]
    assert store.objects(store.names.staging_key("")[:-4]) == []  # both uploads cleaned up
    other_user = store.submit(job_zip("a"), submitter=BOB, submission_id="run-1")
    assert other_user.job_id != first.job_id and not other_user.existed


def test_submission_id_with_different_content_is_refused(store: Store) -> None:
    first = store.submit(job_zip("a"), submission_id="run-1")
    with pytest.raises(AlreadyExists, match="submission id 'run-1' was already used"):
        store.submit(job_zip("b"), submission_id="run-1")
    assert store.state.recent_job_ids() == [first.job_id]
    assert store.objects(store.names.staging_key("")[:-4]) == []
    with pytest.raises(InvalidArgument, match="submission id 'bad id!'"):
        store.submit(job_zip("a"), submission_id="bad id!")


def test_submission_id_of_a_deleted_job_is_refused(store: Store) -> None:
    first = store.submit(job_zip("a"), submission_id="run-1")
    store.move_to(first.job_id, S.FINISHED_ABORTED)
    store.call(admin_pb2.DeleteJobRequest(job_id=first.job_id))
    with pytest.raises(NotFound, match=f"belongs to job {first.job_id}, which was deleted"):
        store.submit(job_zip("a"), submission_id="run-1")
    assert store.objects(f"{store.names.ns}/") == []  # the refused upload left nothing


# list, get --------------------------------------------------------------------------------------
def test_list_filters_and_newest_first_with_200_jobs(store: Store) -> None:
    number: dict[str, int] = {}  # job id -> submission number
    for n in range(200):
        name = f"{'mnist' if n % 2 else 'cifar'}-{n}"
        submitter = Submitter("alice" if n % 3 else "bob")
        record = store.state.create_job(str(uuid.uuid4()), JobMeta(name=name), submitter)
        number[record.job_id] = n
    ids = list(number)
    completed_ids = ids[:50:5]
    for job_id in completed_ids:
        store.move_to(job_id, S.FINISHED_COMPLETED)
    newest_first = ids[::-1]

    def listed(**filters: Any) -> list[str]:
        reply = store.call(admin_pb2.ListJobsRequest(**filters))
        assert isinstance(reply, admin_pb2.ListJobsReply)
        return [job.job_id for job in reply.jobs]

    def newest(keep: Callable[[str], bool]) -> list[str]:
        return [i for i in newest_first if keep(i)]

    completed = status_to_proto(S.FINISHED_COMPLETED)
    submitted = status_to_proto(S.SUBMITTED)
    assert listed() == newest_first[:100]  # the default page
    assert listed(limit=200) == newest_first
    assert listed(limit=7) == newest_first[:7]
    assert listed(name="MNIST", limit=500) == newest(lambda i: number[i] % 2 == 1)
    assert listed(submitter="bob", limit=500) == newest(lambda i: number[i] % 3 == 0)
    assert listed(statuses=[completed]) == completed_ids[::-1]
    assert listed(statuses=[completed, submitted], limit=500) == newest_first
    assert listed(statuses=[submitted], limit=3) == newest(lambda i: i not in completed_ids)[:3]
    prefix = ids[10][:3]
    assert listed(id_prefix=prefix.upper()) == newest(lambda i: i.startswith(prefix))
    assert listed(name="cifar", submitter="alice", statuses=[completed]) == newest(
        lambda i: i in completed_ids and number[i] % 2 == 0 and number[i] % 3 != 0
    )
    assert listed(name="no-such-name") == []
    with pytest.raises(InvalidArgument, match="limit -1"):
        listed(limit=-1)
    with pytest.raises(InvalidArgument, match="JOB_STATUS_UNSPECIFIED"):
        listed(statuses=[job_pb2.JOB_STATUS_UNSPECIFIED])


def test_get_answers_the_full_record_or_not_found(store: Store) -> None:
    job_id = store.submit(job_zip("mnist")).job_id
    store.move_to(job_id, S.RUNNING)
    reply = store.call(admin_pb2.GetJobRequest(job_id=job_id))
    assert isinstance(reply, job_pb2.JobRecord)
    assert reply.job_id == job_id and reply.meta.name == "mnist"
    assert reply.status == status_to_proto(S.RUNNING) and reply.submitter.org == "org-a"
    assert reply.submit_time_ms > 0 and reply.start_time_ms >= reply.submit_time_ms
    assert [h.to_status for h in reply.history] == [
        status_to_proto(s) for s in (S.SUBMITTED, S.DISPATCHED, S.RUNNING)
    ]
    assert reply.archive_key == store.names.job_definition_key(job_id)
    with pytest.raises(NotFound, match="job no-such-job not found"):
        store.call(admin_pb2.GetJobRequest(job_id="no-such-job"))


# clone, delete, download, abort -----------------------------------------------------------------
def test_clone_copies_the_definition_for_a_new_submitter(store: Store) -> None:
    source = store.submit(job_zip("mnist")).job_id
    store.move_to(source, S.FINISHED_COMPLETED)
    reply = store.call(jobstore_pb2.StoreCloneJob(job_id=source, submitter=BOB))
    assert isinstance(reply, admin_pb2.SubmitJobReply) and reply.job_id != source
    clone = store.state.get_job(reply.job_id)
    assert clone.status == S.SUBMITTED and clone.submitter.name == "bob"
    assert clone.meta.extra["cloned_from"] == source and clone.meta.name == "mnist"
    assert clone.meta.deploy_map == store.state.get_job(source).meta.deploy_map
    assert store.blobs.get(clone.archive_key) == store.blobs.get(
        store.names.job_definition_key(source)
    )
    assert clone.archive_key == store.names.job_definition_key(clone.job_id)
    assert store.events.statuses(clone.job_id) == ["SUBMITTED"]
    with pytest.raises(NotFound, match="job nope not found"):
        store.call(jobstore_pb2.StoreCloneJob(job_id="nope", submitter=BOB))


@pytest.mark.parametrize("status", [S.SUBMITTED, S.DISPATCHED, S.RUNNING])
def test_delete_refuses_a_job_that_is_not_final(store: Store, status: JobStatus) -> None:
    job_id = store.submit(job_zip()).job_id
    store.move_to(job_id, status)
    with pytest.raises(FailedPrecondition, match=f"job: {job_id} .*could not be deleted"):
        store.call(admin_pb2.DeleteJobRequest(job_id=job_id))
    assert store.state.get_job(job_id).status == status
    assert store.blobs.exists(store.names.job_definition_key(job_id))


def test_delete_removes_a_final_job_and_its_objects(store: Store) -> None:
    job_id = store.submit(job_zip()).job_id
    keep = store.submit(job_zip()).job_id
    store.move_to(job_id, S.FINISHED_COMPLETED)
    store.blobs.put(store.names.job_result_key(job_id), b"result")
    reply = store.call(admin_pb2.DeleteJobRequest(job_id=job_id))
    assert isinstance(reply, admin_pb2.DeleteJobReply)
    with pytest.raises(NotFound):
        store.state.get_job(job_id)
    assert store.objects(store.names.job_prefix(job_id)) == []
    assert store.state.recent_job_ids() == [keep]
    with pytest.raises(NotFound):
        store.call(admin_pb2.DeleteJobRequest(job_id=job_id))
    # a redelivered delete whose first delivery did the work answers as the first did
    assert isinstance(
        store.call(admin_pb2.DeleteJobRequest(job_id=job_id), redelivered=True),
        admin_pb2.DeleteJobReply,
    )


def test_download_needs_a_finished_job_and_gives_working_urls(store: Store) -> None:
    upload = job_zip("mnist")
    job_id = store.submit(upload).job_id
    request = jobstore_pb2.StoreDownloadJob(job_id=job_id, expires_in_s=300)
    with pytest.raises(FailedPrecondition, match=f"job {job_id} is not done"):
        store.call(request)
    result_key = store.names.job_result_key(job_id)
    store.blobs.put(result_key, b"the result")
    store.move_to(job_id, S.RUNNING)
    store.state.change_status(
        job_id, S.RUNNING, S.FINISHED_COMPLETED, "done", update=JobUpdate(result_key=result_key)
    )
    reply = store.call(request)
    assert isinstance(reply, jobstore_pb2.StoreDownloadReply) and reply.expires_at_ms > 0
    definition = _fetch(reply.definition_url)  # no credentials: the URL alone
    with zipfile.ZipFile(io.BytesIO(definition)) as archive:
        assert "srv/config/config_fed_server.json" in archive.namelist()
    assert definition == load_job(upload).to_zip()
    assert _fetch(reply.result_url) == b"the result"
    with pytest.raises(InvalidArgument, match="expires_in_s"):
        store.call(jobstore_pb2.StoreDownloadJob(job_id=job_id, expires_in_s=-5))


def test_download_of_a_job_without_result_has_no_result_url(store: Store) -> None:
    job_id = store.submit(job_zip()).job_id
    store.move_to(job_id, S.FINISHED_CANT_SCHEDULE)
    reply = store.call(jobstore_pb2.StoreDownloadJob(job_id=job_id))
    assert isinstance(reply, jobstore_pb2.StoreDownloadReply)
    assert reply.definition_url and reply.result_url == ""


def test_abort_of_a_submitted_job(store: Store) -> None:
    job_id = store.submit(job_zip()).job_id
    reply = store.call(admin_pb2.AbortJobRequest(job_id=job_id))
    assert isinstance(reply, job_pb2.JobRecord)
    assert reply.status == status_to_proto(S.FINISHED_ABORTED) and reply.end_time_ms > 0
    assert reply.history[-1].reason == f"Aborted the job {job_id} before running it."
    assert store.events.statuses(job_id) == ["SUBMITTED", "FINISHED:ABORTED"]
    assert store.events.published[-1][2] == f"{job_id}:2"
    with pytest.raises(FailedPrecondition, match=f"job {job_id} is already done"):
        store.call(admin_pb2.AbortJobRequest(job_id=job_id))
    again = store.call(admin_pb2.AbortJobRequest(job_id=job_id), redelivered=True)
    assert isinstance(again, job_pb2.JobRecord) and again.status == reply.status
    other = store.submit(job_zip()).job_id
    aborted = store.call(admin_pb2.AbortJobRequest(job_id=other, reason="by alice: typo"))
    assert isinstance(aborted, job_pb2.JobRecord)
    assert aborted.history[-1].reason == "by alice: typo"


class _RunnerAnswering:
    """A job-runner link that answers an abort (or does not, with `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, Message]] = []
        self.error = error

    def call(self, queue: str, request: Message, reply_type: type[job_pb2.JobRecord], *,
             timeout: float) -> job_pb2.JobRecord:
        self.calls.append((queue, request))
        if self.error is not None:
            raise self.error
        return reply_type(job_id="answered-by-runner")


@pytest.mark.parametrize("status", [S.DISPATCHED, S.RUNNING])
def test_abort_of_a_dispatched_or_running_job_is_forwarded_to_the_runner(
    store: Store, status: JobStatus
) -> None:
    job_id = store.submit(job_zip()).job_id
    store.move_to(job_id, status)
    runner = _RunnerAnswering()
    forwarding = Store(replace(store.ctx, runner=runner), store.events, store.names)
    reply = forwarding.call(admin_pb2.AbortJobRequest(job_id=job_id, reason="by alice"))
    assert isinstance(reply, job_pb2.JobRecord) and reply.job_id == "answered-by-runner"
    assert runner.calls == [(store.names.service_queue("job-runner"),
                             admin_pb2.AbortJobRequest(job_id=job_id, reason="by alice"))]
    silent = _RunnerAnswering(RpcTimeout("no reply"))
    unanswered = Store(replace(store.ctx, runner=silent), store.events, store.names)
    with pytest.raises(Unavailable, match=f"job {job_id} is {status.value} and the job-runner"):
        unanswered.call(admin_pb2.AbortJobRequest(job_id=job_id))
    assert store.state.get_job(job_id).status == status


# sites ------------------------------------------------------------------------------------------
def test_list_sites_from_the_heartbeat_registry(store: Store) -> None:
    reply = store.call(admin_pb2.ListSitesRequest())
    assert isinstance(reply, admin_pb2.ListSitesReply) and list(reply.sites) == []
    store.state.record_heartbeat(SiteHeartbeat("site-2", org="org-b", sent_at_ms=5), ttl_s=60)
    store.state.record_heartbeat(SiteHeartbeat("site-1", sent_at_ms=7), ttl_s=0.3)

    def sites() -> list[tuple[str, bool, int]]:
        listed = store.call(admin_pb2.ListSitesRequest())
        assert isinstance(listed, admin_pb2.ListSitesReply)
        return [(s.last_heartbeat.site, s.online, s.last_heartbeat.sent_at_ms)
                for s in listed.sites]

    assert sites() in ([("site-1", True, 7), ("site-2", True, 5)],
                       [("site-1", False, 0), ("site-2", True, 5)])
    wait_for(lambda: sites() == [("site-1", False, 0), ("site-2", True, 5)], timeout=5,
             what="site-1's heartbeat to expire")


def _fetch(url: str) -> bytes:
    assert url.startswith("http")
    with urllib.request.urlopen(url, timeout=10) as response:
        data: bytes = response.read()
        return data


def test_presigned_url_is_refused_once_expired(store: Store) -> None:
    job_id = store.submit(job_zip()).job_id
    store.move_to(job_id, S.FINISHED_ABORTED)
    reply = store.call(jobstore_pb2.StoreDownloadJob(job_id=job_id, expires_in_s=1))
    assert isinstance(reply, jobstore_pb2.StoreDownloadReply)

    def refused() -> bool:
        try:
            _fetch(reply.definition_url)
        except urllib.error.HTTPError as err:
            return err.code == 403
        return False

    wait_for(refused, timeout=10, interval=0.25, what="the URL to expire")


# submit-time refusal of what can never run (issue 6) ------------------------------------------
def test_submit_refuses_what_no_registered_site_could_run_unless_queued_anyway(
    store: Store,
) -> None:
    store.state.record_heartbeats(
        [SiteHeartbeat("site-1", resources={"total": {"gpu": 1}, "free": {"gpu": 1}},
                       sent_at_ms=1)], 60)
    meta = {"name": "big", "resource_spec": {"site-1": {"gpu": 2}},
            "deploy_map": {"srv": ["server"], "cli": ["site-1", "site-2"]},
            "mandatory_clients": ["site-2"]}
    data = job_zip(files={"meta.json": json.dumps(meta).encode()})
    with pytest.raises(InvalidArgument) as caught:
        store.submit(data)
    message = str(caught.value)
    assert "mandatory site 'site-2' has never registered" in message
    assert "site 'site-1': gpu 2 > 1 in total" in message and "--queue-anyway" in message
    assert store.state.recent_job_ids() == [] and store.events.published == []
    request = jobstore_pb2.StoreSubmitJob(staging_key=stage(store.blobs, store.names, data),
                                          submitter=ALICE, queue_anyway=True)
    reply = store.call(request)
    assert isinstance(reply, admin_pb2.SubmitJobReply)
    assert store.state.get_job(reply.job_id).status is S.SUBMITTED
