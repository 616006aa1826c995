"""Contract of the job part of the state port: records, the status state machine, indexes,
history, fencing. Every test runs against Redis and against the in-memory store."""

from __future__ import annotations

import itertools
import threading

import pytest

from fedhive.errors import AlreadyExists, FedhiveError, IllegalTransition, NotFound
from fedhive.errors import StaleFencingToken as StaleToken
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import INITIAL, TRANSITIONS, JobStatus
from fedhive.state import Fence, JobUpdate, StateStore
from tests.fixtures.state import submit, submit_in

S = JobStatus
ILLEGAL = sorted(set(itertools.product(S, S)) - TRANSITIONS)


def test_create_and_get(state_store: StateStore) -> None:
    created = submit(state_store, "job-1")
    assert created.status == INITIAL
    assert created.submitter.name == "alice" and created.archive_key == "k"
    assert created.meta.resource_spec == {"site-1": {"num_gpus": 1, "mem_gb": 2.5}}
    assert created.submit_time_ms > 0 and created.start_time_ms is None
    assert [(c.from_status, c.to_status) for c in created.history] == [(None, INITIAL)]
    assert created.status_reason == "submitted"
    assert state_store.get_job("job-1") == created


def test_create_keeps_the_job_it_resumes(state_store: StateStore) -> None:
    assert submit(state_store, "job-1").resumed_from == ""
    resumed = state_store.create_job("job-2", JobMeta("job"), Submitter("bob"),
                                     reason="resumed from job job-1", resumed_from="job-1")
    assert resumed.resumed_from == "job-1" and resumed.status_reason == "resumed from job job-1"
    assert state_store.get_job("job-2") == resumed


def test_create_refuses_existing_id(state_store: StateStore) -> None:
    first = submit(state_store, "job-1", name="first")
    with pytest.raises(AlreadyExists, match="job-1"):
        submit(state_store, "job-1", name="second")
    assert state_store.get_job("job-1") == first


def test_unknown_job_is_not_found(state_store: StateStore) -> None:
    with pytest.raises(NotFound, match="nope"):
        state_store.get_job("nope")
    with pytest.raises(NotFound, match="nope"):
        state_store.change_status("nope", S.SUBMITTED, S.DISPATCHED, "x")
    with pytest.raises(NotFound, match="nope"):
        state_store.update_job("nope", JobUpdate(schedule_count=1))


@pytest.mark.parametrize(("old", "new"), sorted(TRANSITIONS), ids=lambda s: str(s.value))
def test_every_legal_transition_succeeds(
    state_store: StateStore, old: JobStatus, new: JobStatus
) -> None:
    before = submit_in(state_store, "job-1", old)
    after = state_store.change_status("job-1", old, new, "because")
    assert after.status == new and after.status_reason == "because"
    assert after.history[:-1] == before.history
    last = after.history[-1]
    assert (last.from_status, last.to_status, last.reason) == (old, new, "because")
    if new == S.RUNNING:
        assert after.start_time_ms is not None and after.start_time_ms >= after.submit_time_ms
    if new.is_final:
        assert after.end_time_ms is not None and after.end_time_ms >= after.submit_time_ms
    else:
        assert after.end_time_ms is None
    assert state_store.get_job("job-1") == after


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda s: str(s.value))
def test_every_illegal_transition_is_rejected(
    state_store: StateStore, old: JobStatus, new: JobStatus
) -> None:
    before = submit_in(state_store, "job-1", old)
    with pytest.raises(IllegalTransition) as caught:
        state_store.change_status("job-1", old, new, "nope", update=JobUpdate(result_key="r"))
    assert "job-1" in str(caught.value) and old.value in str(caught.value)
    assert new.value in str(caught.value) and "\n" not in str(caught.value)
    assert state_store.get_job("job-1") == before
    assert [j.job_id for j in state_store.list_jobs(old)] == ["job-1"]


def test_stale_expected_status_is_rejected(state_store: StateStore) -> None:
    before = submit_in(state_store, "job-1", S.DISPATCHED)
    with pytest.raises(IllegalTransition, match=r"job-1 is DISPATCHED, not SUBMITTED"):
        state_store.change_status("job-1", S.SUBMITTED, S.FINISHED_ABORTED, "late abort")
    assert state_store.get_job("job-1") == before


def test_status_change_sets_fields_in_the_same_step(state_store: StateStore) -> None:
    submit_in(state_store, "job-1", S.RUNNING)
    update = JobUpdate(sites=["a", "b"], failed_sites=["b"], result_key="results/job-1.zip")
    after = state_store.change_status(
        "job-1", S.RUNNING, S.FINISHED_COMPLETED, "done", update=update
    )
    assert (after.sites, after.failed_sites) == (["a", "b"], ["b"])
    assert after.result_key == "results/job-1.zip"
    assert after.archive_key == "k"  # untouched


def test_concurrent_writers_exactly_one_wins(state_store: StateStore) -> None:
    jobs = [f"job-{i}" for i in range(20)]
    for job_id in jobs:
        submit(state_store, job_id)
    outcomes: dict[tuple[str, JobStatus], str] = {}

    def writer(job_id: str, new: JobStatus, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            state_store.change_status(job_id, S.SUBMITTED, new, f"writer {new.value}")
            outcomes[(job_id, new)] = "won"
        except IllegalTransition:
            outcomes[(job_id, new)] = "lost"

    threads = []
    for job_id in jobs:
        barrier = threading.Barrier(2)
        for new in (S.DISPATCHED, S.FINISHED_ABORTED):
            threads.append(threading.Thread(target=writer, args=(job_id, new, barrier)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for job_id in jobs:
        results = {new: outcomes[(job_id, new)] for new in (S.DISPATCHED, S.FINISHED_ABORTED)}
        assert sorted(results.values()) == ["lost", "won"], (job_id, results)
        winner = next(new for new, result in results.items() if result == "won")
        record = state_store.get_job(job_id)
        assert record.status == winner and len(record.history) == 2


def test_indexes_and_history_follow_transitions(state_store: StateStore) -> None:
    submit(state_store, "job-b")
    submit(state_store, "job-a")
    submit(state_store, "job-c")
    state_store.change_status("job-a", S.SUBMITTED, S.DISPATCHED, "go")
    state_store.change_status("job-a", S.DISPATCHED, S.RUNNING, "started")
    state_store.change_status("job-c", S.SUBMITTED, S.FINISHED_CANT_SCHEDULE, "no sites")

    def ids(status: JobStatus | None = None) -> list[str]:
        return [record.job_id for record in state_store.list_jobs(status)]

    assert ids() == ["job-b", "job-a", "job-c"]  # submission order, not name order
    assert ids(S.SUBMITTED) == ["job-b"]
    assert ids(S.RUNNING) == ["job-a"]
    assert ids(S.FINISHED_CANT_SCHEDULE) == ["job-c"]
    assert ids(S.DISPATCHED) == []
    history = state_store.get_job("job-a").history
    assert [(c.from_status, c.to_status, c.reason) for c in history] == [
        (None, S.SUBMITTED, "submitted"),
        (S.SUBMITTED, S.DISPATCHED, "go"),
        (S.DISPATCHED, S.RUNNING, "started"),
    ]
    assert [c.at_ms for c in history] == sorted(c.at_ms for c in history)


def test_update_job_sets_only_given_fields(state_store: StateStore) -> None:
    submit(state_store, "job-1")
    updated = state_store.update_job(
        "job-1",
        JobUpdate(
            schedule_count=3,
            last_schedule_time_ms=1_700_000_000_000,
            next_schedule_time_ms=1_700_000_060_000,
            pending_reason={"site-1": "num_gpus 2 > 1 free"},
        ),
    )
    assert (updated.schedule_count, updated.next_schedule_time_ms) == (3, 1_700_000_060_000)
    assert updated.pending_reason == {"site-1": "num_gpus 2 > 1 free"}
    assert updated.status == S.SUBMITTED and updated.archive_key == "k"
    cleared = state_store.update_job("job-1", JobUpdate(pending_reason={}))
    assert cleared.pending_reason == {} and cleared.schedule_count == 3
    assert state_store.get_job("job-1") == cleared


def test_delete_job_removes_record_history_and_index_entries(state_store: StateStore) -> None:
    submit_in(state_store, "job-1", S.RUNNING)
    submit(state_store, "job-2")
    assert state_store.delete_job("job-1") is True
    with pytest.raises(NotFound):
        state_store.get_job("job-1")
    assert [r.job_id for r in state_store.list_jobs()] == ["job-2"]
    assert state_store.list_jobs(S.RUNNING) == []
    assert state_store.delete_job("job-1") is False
    again = submit(state_store, "job-1")  # the id is free again, with a fresh history
    assert len(again.history) == 1


def test_stale_fencing_token_cannot_change_a_job(state_store: StateStore) -> None:
    old_token = state_store.acquire("scheduler", "old-leader", 30)
    assert old_token is not None
    state_store.release("scheduler", "old-leader", old_token)
    new_token = state_store.acquire("scheduler", "new-leader", 30)
    assert new_token is not None and new_token > old_token
    before = submit(state_store, "job-1")
    stale = Fence("scheduler", old_token)
    with pytest.raises(StaleToken) as caught:
        state_store.change_status("job-1", S.SUBMITTED, S.DISPATCHED, "deposed", fence=stale)
    assert "job-1" in str(caught.value) and "scheduler" in str(caught.value)
    with pytest.raises(StaleToken):
        state_store.update_job("job-1", JobUpdate(schedule_count=9), fence=stale)
    assert state_store.get_job("job-1") == before
    current = Fence("scheduler", new_token)
    after: JobRecord = state_store.change_status(
        "job-1", S.SUBMITTED, S.DISPATCHED, "leader", fence=current
    )
    assert after.status == S.DISPATCHED


def test_errors_are_typed_fedhive_errors(state_store: StateStore) -> None:
    with pytest.raises(FedhiveError) as caught:
        state_store.get_job("missing")
    assert caught.value.code == "NOT_FOUND" and caught.value.field == "job_id"


def test_recent_job_ids_are_newest_first_and_paged(state_store: StateStore) -> None:
    for n in range(7):
        submit(state_store, f"job-{n}")
    newest_first = [f"job-{n}" for n in reversed(range(7))]
    assert state_store.recent_job_ids(count=100) == newest_first
    assert state_store.recent_job_ids(start=2, count=3) == newest_first[2:5]
    assert state_store.recent_job_ids(start=7, count=3) == []
    assert state_store.recent_job_ids(count=0) == []
    state_store.change_status("job-2", S.SUBMITTED, S.FINISHED_ABORTED, "stop")
    state_store.change_status("job-5", S.SUBMITTED, S.FINISHED_ABORTED, "stop")
    assert state_store.recent_job_ids(S.FINISHED_ABORTED) == ["job-5", "job-2"]
    assert state_store.recent_job_ids(S.SUBMITTED, start=1, count=2) == ["job-4", "job-3"]


def test_get_jobs_keeps_order_and_skips_missing(state_store: StateStore) -> None:
    for n in range(3):
        submit(state_store, f"job-{n}", name=f"name-{n}")
    state_store.delete_job("job-1")
    records = state_store.get_jobs(["job-2", "job-1", "nope", "job-0"])
    assert [r.job_id for r in records] == ["job-2", "job-0"]
    assert records[0] == state_store.get_job("job-2") and records[1].meta.name == "name-0"
    assert state_store.get_jobs([]) == []


def test_dispatch_records_reservations_and_conditional_update(state_store: StateStore) -> None:
    submit(state_store, "job-1")
    done = state_store.change_status(
        "job-1", JobStatus.SUBMITTED, JobStatus.DISPATCHED, "scheduled",
        update=JobUpdate(sites=["s1"], reservations={"s1": "tok"}))
    assert done.reservations == {"s1": "tok"}
    assert state_store.get_job("job-1").reservations == {"s1": "tok"}
    with pytest.raises(IllegalTransition, match="job-1 is DISPATCHED, not SUBMITTED"):
        state_store.update_job("job-1", JobUpdate(pending_reason={"x": 1}),
                               expected=JobStatus.SUBMITTED)
    assert state_store.get_job("job-1").pending_reason == {}
    kept = state_store.update_job("job-1", JobUpdate(schedule_count=2),
                                  expected=JobStatus.DISPATCHED)
    assert kept.schedule_count == 2
