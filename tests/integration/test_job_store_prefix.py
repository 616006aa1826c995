"""Job-id prefixes: `StateStore.find_job_ids` (both implementations) and the job-store's lookup
(`context.lookup_job`: an exact id first, else a unique case-insensitive prefix), on real Redis
and S3 with the handlers called as the bus consumer calls them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.errors import InvalidArgument, NotFound
from fedhive.jobs.record import JobMeta, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.state import RedisStateStore, StateStore
from fedhive.state.redis_store import prefix_pattern
from fedhive.state.rounds import RoundLog
from fedhive_services.job_store.context import SHOWN_MATCHES
from tests.fixtures.job_store import job_zip, stage
from tests.fixtures.job_store_handlers import ALICE, BOB, NoRunner, Store, handler_store

S = JobStatus
META = JobMeta(name="j", deploy_map={"app": ["server", "site-1"]})
WHO = Submitter("alice", "org-a", "lead")
ABC = "abc10000-0000-4000-8000-000000000001"
ABD = "abd20000-0000-4000-8000-000000000002"


# the state port: both implementations ----------------------------------------------------------
def test_find_job_ids_ignores_case_and_stops_at_the_limit(state_store: StateStore) -> None:
    for job_id in ("abc-1", "ABD-2", "abd-3", "b-4", "a*b-5", "axb-6", "a?c-7"):
        state_store.create_job(job_id, META, WHO)
    assert state_store.find_job_ids("AB", limit=10) == ["ABD-2", "abc-1", "abd-3"]
    assert state_store.find_job_ids("abd", limit=10) == ["ABD-2", "abd-3"]
    assert state_store.find_job_ids("abd-3", limit=10) == ["abd-3"]
    assert len(state_store.find_job_ids("ab", limit=2)) == 2
    assert state_store.find_job_ids("zz", limit=10) == []
    assert state_store.find_job_ids("a", limit=0) == []
    # Glob characters are themselves, not wildcards.
    assert state_store.find_job_ids("a*", limit=10) == ["a*b-5"]
    assert state_store.find_job_ids("a?", limit=10) == ["a?c-7"]


def test_find_job_ids_walks_a_large_index(state_store: StateStore) -> None:
    """More ids than one ZSCAN batch examines (and than Redis keeps in a listpack)."""
    for i in range(1_500):
        state_store.create_job(f"{i:04d}-job", META, WHO)
    assert state_store.find_job_ids("0123", limit=10) == ["0123-job"]
    assert state_store.find_job_ids("149", limit=100) == [f"149{i}-job" for i in range(10)]
    assert len(state_store.find_job_ids("1", limit=5)) == 5


def test_prefix_pattern_escapes_globs_and_ignores_case() -> None:
    assert prefix_pattern("aB3-") == "[aA][bB]3-*"
    assert prefix_pattern("a*?[]\\^") == "[aA]\\*\\?\\[\\]\\\\\\^*"
    assert prefix_pattern("aé1") == "[aA]*"  # past a non-ASCII character: compared in Python
    assert prefix_pattern("") == "*"


# the job-store's lookup -----------------------------------------------------------------------
class _Runner:
    """A job-runner link that records the abort it is asked for and answers it."""

    def __init__(self) -> None:
        self.calls: list[Message] = []

    def call(self, queue: str, request: Message, reply_type: type[job_pb2.JobRecord], *,
             timeout: float) -> job_pb2.JobRecord:
        self.calls.append(request)
        return reply_type(job_id="answered-by-runner")


class _Counting:
    """The state port, counting the calls made to it."""

    def __init__(self, inner: RedisStateStore) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.inner, name)


@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog
          ) -> Iterator[Store]:
    yield handler_store(redis_state, job_store_blobs, round_log, NoRunner())


def _submit(store: Store, job_id: str, submitter: job_pb2.Submitter = ALICE) -> str:
    reply = store.call(jobstore_pb2.StoreSubmitJob(
        staging_key=stage(store.blobs, store.names, job_zip("prefix")), submitter=submitter,
        job_id=job_id))
    assert isinstance(reply, admin_pb2.SubmitJobReply) and reply.job_id == job_id
    return job_id


def test_get_and_metrics_take_a_unique_prefix_in_any_case(store: Store) -> None:
    _submit(store, ABC), _submit(store, ABD)
    for given in ("abc", "ABC1", "Abc10000-0000-4000-8000-00000000000", ABC.upper()):
        reply = store.call(admin_pb2.GetJobRequest(job_id=given))
        assert isinstance(reply, job_pb2.JobRecord) and reply.job_id == ABC, given
    metrics = store.call(admin_pb2.GetJobMetricsRequest(job_id="ABD"))
    assert isinstance(metrics, admin_pb2.JobMetrics) and metrics.job_id == ABD


def test_an_ambiguous_prefix_names_it_and_some_matches(store: Store) -> None:
    _submit(store, ABC), _submit(store, ABD)
    with pytest.raises(InvalidArgument) as raised:
        store.call(admin_pb2.GetJobRequest(job_id="AB"))
    assert str(raised.value) == (f"job id prefix AB is ambiguous: it matches {ABC}, {ABD}; "
                                 "give more of the id")
    assert raised.value.field == "job_id"
    many = [f"abe{i}0000-0000-4000-8000-00000000000{i}" for i in range(SHOWN_MATCHES + 2)]
    for job_id in many:
        _submit(store, job_id)
    with pytest.raises(InvalidArgument) as raised:
        store.call(jobstore_pb2.StoreCloneJob(job_id="abe", submitter=BOB))
    assert str(raised.value) == (f"job id prefix abe is ambiguous: it matches "
                                 f"{', '.join(many[:SHOWN_MATCHES])}, ...; give more of the id")


def test_an_unknown_id_or_prefix_is_not_found_and_an_empty_one_invalid(store: Store) -> None:
    _submit(store, ABC)
    with pytest.raises(NotFound, match=r"^job abz not found$"):
        store.call(admin_pb2.GetJobRequest(job_id="abz"))
    with pytest.raises(NotFound, match=r"^job abc1-x not found$"):
        store.call(admin_pb2.DeleteJobRequest(job_id="abc1-x"))
    with pytest.raises(InvalidArgument, match="job_id is required"):
        store.call(admin_pb2.GetJobRequest(job_id=""))


def test_clone_resume_delete_download_abort_act_on_the_full_id(store: Store) -> None:
    _submit(store, ABC), _submit(store, ABD)
    clone = store.call(jobstore_pb2.StoreCloneJob(job_id="ABC", submitter=BOB))
    assert isinstance(clone, admin_pb2.SubmitJobReply)
    assert store.state.get_job(clone.job_id).meta.extra["cloned_from"] == ABC

    aborted = store.call(admin_pb2.AbortJobRequest(job_id="abc1", reason="by prefix"))
    assert isinstance(aborted, job_pb2.JobRecord) and aborted.job_id == ABC
    assert store.state.get_job(ABC).status == S.FINISHED_ABORTED

    store.blobs.put(store.names.job_checkpoint_key(ABC), b"round 1")
    resumed = store.call(jobstore_pb2.StoreResumeJob(job_id="abc", submitter=ALICE))
    assert isinstance(resumed, admin_pb2.SubmitJobReply)
    assert store.state.get_job(resumed.job_id).resumed_from == ABC

    urls = store.call(jobstore_pb2.StoreDownloadJob(job_id="aBc"))
    assert isinstance(urls, jobstore_pb2.StoreDownloadReply) and ABC in urls.definition_url

    store.call(admin_pb2.DeleteJobRequest(job_id="abc"))
    with pytest.raises(NotFound):
        store.state.get_job(ABC)
    assert store.state.get_job(ABD).job_id == ABD


def test_an_abort_forwarded_to_the_runner_names_the_full_id(store: Store) -> None:
    _submit(store, ABC)
    store.move_to(ABC, S.RUNNING)
    runner = _Runner()
    forwarding = Store(replace(store.ctx, runner=runner), store.events, store.names)
    forwarding.call(admin_pb2.AbortJobRequest(job_id="ABC", reason="stop"))
    assert runner.calls == [admin_pb2.AbortJobRequest(job_id=ABC, reason="stop")]


def test_a_prefix_lookup_reads_the_id_index_not_the_records(store: Store) -> None:
    for i in range(50):
        _submit(store, f"{i:02d}000000-0000-4000-8000-000000000000")
    counting = _Counting(store.state)
    looking = Store(replace(store.ctx, state=counting), store.events, store.names)
    reply = looking.call(admin_pb2.GetJobRequest(job_id="42"))
    assert isinstance(reply, job_pb2.JobRecord) and reply.job_id.startswith("42000000")
    # the exact id first, then the index, then the one record found
    assert counting.calls == ["get_job", "find_job_ids", "get_job"]
