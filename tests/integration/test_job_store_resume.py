"""The job-store's resume handler on real Redis and S3: a new job from an aborted or failed one
that left a checkpoint, and the clear refusals when there is nothing to resume.

The `Store` harness is test_job_store_handlers.py's.
"""

from __future__ import annotations

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.errors import FailedPrecondition, NotFound
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, jobstore_pb2
from fedhive.state import RedisStateStore
from fedhive.state.rounds import RoundLog
from fedhive_services.job_store.submit import RESUMABLE
from tests.fixtures.job_store import job_zip
from tests.fixtures.job_store_handlers import BOB, NoRunner, Store, handler_store

S = JobStatus


@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog
          ) -> Store:
    return handler_store(redis_state, job_store_blobs, round_log, NoRunner())


def _ended(store: Store, status: JobStatus, *, checkpoint: bool = True,
           name: str = "mnist") -> str:
    """A job in `status` that (with `checkpoint`) completed at least one round."""
    job_id = store.submit(job_zip(name)).job_id
    store.move_to(job_id, status)
    if checkpoint:
        store.blobs.put(store.names.job_checkpoint_key(job_id), b"round 3 of 5")
    return job_id


def _resume(store: Store, job_id: str, message_id: str | None = None
            ) -> admin_pb2.SubmitJobReply:
    reply = store.call(jobstore_pb2.StoreResumeJob(job_id=job_id, submitter=BOB),
                       message_id=message_id)
    assert isinstance(reply, admin_pb2.SubmitJobReply)
    return reply


@pytest.mark.parametrize("status", RESUMABLE, ids=lambda s: s.value)
def test_resume_makes_a_new_job_that_names_its_source(store: Store, status: JobStatus) -> None:
    source = _ended(store, status)
    reply = _resume(store, source)
    assert reply.job_id != source and not reply.existed
    resumed = store.state.get_job(reply.job_id)
    assert resumed.status == S.SUBMITTED and resumed.resumed_from == source
    assert resumed.submitter.name == "bob" and resumed.meta == store.state.get_job(source).meta
    assert resumed.status_reason == f"resumed from job {source}"
    assert resumed.archive_key == store.names.job_definition_key(resumed.job_id)
    assert store.blobs.get(resumed.archive_key) == store.blobs.get(
        store.names.job_definition_key(source)
    )
    assert store.events.statuses(resumed.job_id) == ["SUBMITTED"]
    # the source is untouched: still final, its checkpoint still there for the new job
    assert store.state.get_job(source).status == status
    assert store.blobs.exists(store.names.job_checkpoint_key(source))
    # a GetJob shows the link on the wire
    record = store.call(admin_pb2.GetJobRequest(job_id=resumed.job_id))
    assert record.resumed_from == source  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "status",
    [S.SUBMITTED, S.DISPATCHED, S.RUNNING, S.FINISHED_COMPLETED, S.FINISHED_CANT_SCHEDULE,
     S.FINISHED_FAILED_TO_RUN],
    ids=lambda s: s.value,
)
def test_only_aborted_or_failed_jobs_can_be_resumed(store: Store, status: JobStatus) -> None:
    source = _ended(store, status)
    before = store.state.recent_job_ids()
    with pytest.raises(FailedPrecondition) as refused:
        _resume(store, source)
    assert str(refused.value) == (
        f"job {source} is {status.value}; only ABORTED, EXECUTION_EXCEPTION or ABNORMAL jobs "
        "can be resumed"
    )
    assert store.state.recent_job_ids() == before


def test_a_job_without_a_checkpoint_has_nothing_to_resume(store: Store) -> None:
    source = _ended(store, S.FINISHED_EXECUTION_EXCEPTION, checkpoint=False)
    with pytest.raises(FailedPrecondition) as refused:
        _resume(store, source)
    assert str(refused.value) == f"job {source} completed no round: nothing to resume from"
    assert store.state.recent_job_ids() == [source]


def test_an_unknown_job_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as missing:
        _resume(store, "nope")
    assert str(missing.value) == "job nope not found"


def test_a_resumed_clone_drops_the_clone_link(store: Store) -> None:
    original = _ended(store, S.FINISHED_COMPLETED, checkpoint=False)
    clone = store.call(jobstore_pb2.StoreCloneJob(job_id=original, submitter=BOB))
    clone_id = clone.job_id  # type: ignore[attr-defined]
    store.move_to(clone_id, S.FINISHED_ABORTED)
    store.blobs.put(store.names.job_checkpoint_key(clone_id), b"round 1")
    resumed = store.state.get_job(_resume(store, clone_id).job_id)
    assert resumed.resumed_from == clone_id and "cloned_from" not in resumed.meta.extra


def test_redelivered_resume_makes_no_second_job(store: Store) -> None:
    source = _ended(store, S.FINISHED_ABNORMAL)
    store.events.fail_next = True  # the first delivery dies at the announcement
    with pytest.raises(ConnectionError):
        _resume(store, source, message_id="m-1")
    again = _resume(store, source, message_id="m-1")
    assert sorted(store.state.recent_job_ids()) == sorted([source, again.job_id])
    assert store.events.statuses(again.job_id) == ["SUBMITTED"]
    assert _resume(store, source, message_id="m-1").job_id == again.job_id
