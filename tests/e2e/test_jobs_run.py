"""Scheduling and running end to end: job-store, two scheduler replicas, the job-runner (with
the heartbeat intake) and site agents on their own broker users, all real processes, started
once for the module (tests/fixtures/e2e.py). Jobs are the test jobs of
tests/fixtures/job_runner.py (server workflows Done / Hold), submitted through the job-store.

The system is shared: each test leaves every job it made final, so the next starts idle.
"""

from __future__ import annotations

import threading
from itertools import pairwise

from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from tests.fixtures.e2e import SCHEDULER_OPTIONS, System
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import flow, flow_job

S = JobStatus
DONE = flow("Done", message="e2e")
HOLD = flow("Hold")


def at(record: JobRecord, status: JobStatus) -> int:
    """When the job reached `status` (from its history)."""
    return next(change.at_ms for change in record.history if change.to_status is status)


def test_jobs_run_one_after_another_in_submission_order(e2e_system: System) -> None:
    system = e2e_system
    sites = system.sites[:2]
    job_ids = [system.submit(flow_job(DONE, sites=sites)) for _ in range(3)]
    records = [system.wait_status(job_id, S.FINISHED_COMPLETED) for job_id in job_ids]
    for earlier, later in pairwise(records):
        assert at(later, S.DISPATCHED) >= at(earlier, S.FINISHED_COMPLETED), (
            f"{later.job_id} dispatched before {earlier.job_id} ended (max_jobs 1)")
    assert [r.job_id for r in sorted(records, key=lambda r: at(r, S.DISPATCHED))] == job_ids
    for record in records:
        assert record.sites == sites
        assert system.result(record)["model.txt"] == b"e2e"
    wait_for(lambda: all(system.freed(job_id) for job_id in job_ids), timeout=10,
             what="sites freed")


def test_a_job_needing_more_gpus_than_any_site_has_cannot_be_scheduled(
    e2e_system: System,
) -> None:
    system = e2e_system
    site = system.sites[0]
    system.restart_schedulers("--max-jobs", "1", "--max-schedule-count", "3",
                              "--min-schedule-interval", "0.2",
                              "--max-schedule-interval", "0.4", "--check-timeout", "5")
    try:
        job_id = system.submit(flow_job(DONE, sites=[site], resource_spec={site: {"gpu": 2}}),
                               queue_anyway=True)
        record = system.wait_final(job_id, timeout=30)
        assert record.status is S.FINISHED_CANT_SCHEDULE, record.status_reason
        assert record.schedule_count == 3
        assert "exceeded max schedule count 3" in record.status_reason
        assert f"{site}: gpu 2 > 1 on this site" in record.status_reason
        assert record.start_time_ms is None
        wait_for(lambda: system.freed(job_id), timeout=10, what="no reservation left")
    finally:
        system.restart_schedulers(*SCHEDULER_OPTIONS, replicas=2)


def test_a_job_waits_for_its_offline_mandatory_site_and_runs_when_it_comes_online(
    e2e_system: System,
) -> None:
    system = e2e_system
    first, third = system.agents[0], system.agents[2]
    job_id = system.submit(flow_job(DONE, sites=[first.site, third.site],
                                    mandatory_clients=[third.site]), queue_anyway=True)
    pending = wait_for(lambda: system.job(job_id).pending_reason.get("offline_sites"),
                       timeout=15, what="the pending reason to name the offline site")
    assert pending == [third.site]
    record = system.job(job_id)
    assert record.status is S.SUBMITTED
    assert third.site in record.pending_reason["summary"], record.pending_reason
    third.launch()
    try:
        record = system.wait_status(job_id, S.FINISHED_COMPLETED)
        assert record.sites == [first.site, third.site]
        # its client job was started (the `Done` server app may end the job before that
        # client job has written its report)
        assert record.site_states[third.site]["started"], record.site_states
    finally:
        third.stop()
        third.proc = None


def test_abort_of_a_submitted_job(e2e_system: System) -> None:
    system = e2e_system
    site = system.sites[0]
    offline = system.agents[2].site  # not running: the job waits
    job_id = system.submit(flow_job(DONE, sites=[site, offline], mandatory_clients=[offline]),
                           queue_anyway=True)
    wait_for(lambda: system.job(job_id).pending_reason, timeout=15, what="a pending reason")
    assert system.abort(job_id).job_id == job_id
    record = system.job(job_id)
    assert record.status is S.FINISHED_ABORTED and record.start_time_ms is None
    assert "before running it" in record.status_reason


def test_abort_of_a_dispatched_job(e2e_system: System) -> None:
    system = e2e_system
    system.runner.stop()  # the dispatch command waits in the runner's queue
    job_id = system.submit(flow_job(DONE, sites=system.sites[:2]))
    system.wait_status(job_id, S.DISPATCHED)
    replies: list[object] = []
    aborting = threading.Thread(target=lambda: replies.append(system.abort(job_id)))
    aborting.start()
    system.runner.start()
    aborting.join(60)
    record = system.wait_final(job_id)
    assert record.status is S.FINISHED_ABORTED, record.status_reason
    assert replies and getattr(replies[0], "job_id", "") == job_id
    wait_for(lambda: system.freed(job_id), timeout=15, what="sites freed")


def test_abort_of_a_running_job(e2e_system: System) -> None:
    system = e2e_system
    job_id = system.submit(flow_job(HOLD, sites=system.sites[:2]))
    system.wait_status(job_id, S.RUNNING)
    assert system.abort(job_id).job_id == job_id
    record = system.wait_final(job_id)
    assert record.status is S.FINISHED_ABORTED
    wait_for(lambda: system.freed(job_id), timeout=15, what="sites freed")


def test_a_killed_job_runner_restarts_and_the_job_completes_once(e2e_system: System) -> None:
    system = e2e_system
    launched = system.runner.logged("job_runner.server_job_launched")
    job_id = system.submit(flow_job(HOLD, sites=system.sites[:2]))
    system.wait_status(job_id, S.RUNNING)
    system.runner.kill()
    system.runner.start()
    wait_for(lambda: system.runner.logged("job_runner.reattached") >= 1, timeout=20,
             what="the runner to re-attach")
    system.go(job_id)
    record = system.wait_status(job_id, S.FINISHED_COMPLETED)
    assert system.result(record)["model.txt"] == b"held"
    assert system.runner.logged("job_runner.server_job_launched") == launched + 1
    wait_for(lambda: system.freed(job_id), timeout=15, what="sites freed")


def test_scheduling_goes_on_after_the_leader_is_killed(e2e_system: System) -> None:
    system = e2e_system
    assert len(system.live_schedulers()) == 2
    leader = system.leader()
    token = system.state.get_lease("scheduler")
    system.kill(leader)
    job_id = system.submit(flow_job(DONE, sites=system.sites[:2]))
    system.wait_status(job_id, S.FINISHED_COMPLETED)
    successor = system.leader()
    assert successor is not leader
    lease = system.state.get_lease("scheduler")
    assert token is not None and lease is not None and lease.token > token.token
    system.start_scheduler(*SCHEDULER_OPTIONS)  # two replicas again


def test_a_site_killed_mid_job_ends_the_job_clearly(e2e_system: System) -> None:
    system = e2e_system
    first, second = system.agents[:2]
    job_id = system.submit(flow_job(HOLD, sites=[first.site, second.site]))
    system.wait_status(job_id, S.RUNNING)
    second.kill()
    try:
        wait_for(lambda: system.runner.logged("job_runner.site_gone") >= 1, timeout=20,
                 what="the runner to see the site gone")
        system.go(job_id)  # Hold needs no particular site: it completes on what is left
        record = system.wait_final(job_id)
        assert record.status is S.FINISHED_COMPLETED, record.status_reason
        assert record.status_reason == "server job completed"
        assert record.site_states[second.site]["gone"] in (
            "site went offline", "site stopped reporting the job"), record.site_states
        assert not record.site_states[first.site]["gone"], record.site_states
    finally:
        second.launch()  # reconciles: the client job it lost is recorded as LOST
        system.wait_online(second.site)
    wait_for(lambda: system.freed(job_id), timeout=20, what="sites freed")
