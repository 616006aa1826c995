"""The invariant checker itself: it sees what a job still holds while it runs (as it would see a
leak once the job ended), a job that never ends, and a history that ends or starts twice."""

from __future__ import annotations

import dataclasses

from fedhive.jobs.record import StatusChange
from fedhive.jobs.status import JobStatus
from tests.faults.harness import Faults
from tests.faults.scenarios import HOLD

S = JobStatus


def test_the_checker_sees_a_jobs_processes_allocations_and_a_job_that_does_not_end(
    faults: Faults,
) -> None:
    trial = faults.begin("checker")
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    [stuck] = faults.checker.check([job_id], wait_s=0, settle_s=0)
    assert (stuck.kind, stuck.what) == ("stuck", "still RUNNING")

    held = {(v.kind, v.what) for v in faults.checker.leftovers([job_id])}
    assert ("process_left", "its server job still runs") in held
    assert ("allocation_left", "still in the running-jobs table") in held
    for site in faults.sites:
        assert ("allocation_left", f"site {site} still holds it") in held
    client_jobs = [v for v in faults.checker.leftovers([job_id])
                   if v.what == "its client job still runs"]
    assert len(client_jobs) == len(faults.sites)

    faults.go(job_id)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
    record = faults.system.job(job_id)
    again = [StatusChange(S.RUNNING, S.RUNNING, "again", 0),
             StatusChange(S.RUNNING, S.FINISHED_ABORTED, "twice", 0)]
    found = faults.checker.check_record(dataclasses.replace(record,
                                                            history=record.history + again))
    assert {(v.kind, v.what) for v in found} == {
        ("final_status", "2 final entries in its history"),
        ("run_twice", "2 changes to RUNNING")}
