"""The job-store's pure parts: job ids from message ids, list filters and paging, request
checks. Listing runs on the in-memory state store (same contract as Redis)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2
from fedhive.state.memory_store import MemoryStateStore
from fedhive_services.job_store import queries
from fedhive_services.job_store.context import job_id_for
from fedhive_services.job_store.queries import JobFilter, find_jobs, job_filter, page_size


def test_job_ids_are_uuid4_strings_fixed_by_message_id_and_namespace() -> None:
    first = job_id_for("ns", "message-1")
    assert uuid.UUID(first).version == 4 and str(uuid.UUID(first)) == first
    assert job_id_for("ns", "message-1") == first
    assert job_id_for("ns", "message-2") != first
    assert job_id_for("other-ns", "message-1") != first
    assert job_id_for("ns", None) != job_id_for("ns", None)  # no message id: random


def _store(count: int) -> tuple[MemoryStateStore, list[str]]:
    store = MemoryStateStore()
    ids = []
    for n in range(count):
        meta = JobMeta(name=f"{'Mnist' if n % 2 else 'cifar'}-{n}")
        record = store.create_job(f"{n:04d}-{uuid.uuid4()}", meta, Submitter(f"user-{n % 3}"))
        ids.append(record.job_id)
    return store, ids


def test_find_jobs_walks_past_one_batch_newest_first() -> None:
    store, ids = _store(queries.BATCH * 2 + 30)
    newest_first = ids[::-1]
    assert [r.job_id for r in find_jobs(store, JobFilter(), 1000)] == newest_first
    assert [r.job_id for r in find_jobs(store, JobFilter(), 5)] == newest_first[:5]
    rare = JobFilter(name="mnist-41")  # substring: also matches mnist-410..419
    assert [r.job_id for r in find_jobs(store, rare, 100)] == [
        i for i in newest_first if "mnist-41" in store.get_job(i).meta.name.lower()
    ]
    assert [r.job_id for r in find_jobs(store, JobFilter(id_prefix="0003"), 100)] == [
        i for i in newest_first if i.startswith("0003")
    ]


def test_find_jobs_lists_no_job_twice_when_jobs_arrive_during_the_walk() -> None:
    store, ids = _store(queries.BATCH + 10)

    class Growing(MemoryStateStore):
        """Submits a new job before each of the first pages is read, shifting them by one."""

        def __init__(self, inner: MemoryStateStore) -> None:
            self.inner = inner
            self.added: list[str] = []

        def recent_job_ids(
            self, status: JobStatus | None = None, *, start: int = 0, count: int = 100
        ) -> list[str]:
            if len(self.added) < 2:
                late = self.inner.create_job(str(uuid.uuid4()), JobMeta(name="late"),
                                             Submitter("x"))
                self.added.append(late.job_id)
            return self.inner.recent_job_ids(status, start=start, count=count)

        def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
            return self.inner.get_jobs(job_ids)

    growing = Growing(store)
    listed = [r.job_id for r in find_jobs(growing, JobFilter(name="-"), 10_000)]
    assert len(listed) == len(set(listed)) == len(ids)
    assert listed == ids[::-1]


def test_filters_combine_with_and() -> None:
    store, ids = _store(30)
    store.change_status(ids[4], JobStatus.SUBMITTED, JobStatus.FINISHED_ABORTED, "x")
    store.change_status(ids[7], JobStatus.SUBMITTED, JobStatus.FINISHED_ABORTED, "x")
    request = admin_pb2.ListJobsRequest(
        statuses=[status_to_proto(JobStatus.FINISHED_ABORTED)], name="MNIST", submitter="user-1"
    )
    wanted = job_filter(request)
    assert wanted == JobFilter(
        statuses=frozenset({JobStatus.FINISHED_ABORTED}), name="mnist", submitter="user-1"
    )
    assert [r.job_id for r in find_jobs(store, wanted, 10)] == [ids[7]]  # 7: odd, 7 % 3 == 1


@pytest.mark.parametrize(("limit", "size"), [(0, 100), (1, 1), (10_000, 10_000)])
def test_page_size(limit: int, size: int) -> None:
    assert page_size(limit) == size


@pytest.mark.parametrize("limit", [-1, 10_001])
def test_page_size_out_of_range_names_the_field(limit: int) -> None:
    with pytest.raises(InvalidArgument, match=f"limit {limit} must be between") as caught:
        page_size(limit)
    assert caught.value.field == "limit"
