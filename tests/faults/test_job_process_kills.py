"""SIGKILL of a job's own processes at each state where they exist: its server job, a client
job before and after its first job heartbeat, a trainer. The job ends (the runner acts on what
died), exactly once, and nothing is left behind."""

from __future__ import annotations

import pytest

from fedhive.jobs.status import JobStatus
from fedhive_services.job_runner.liveness import NOT_RUNNING
from tests.faults.harness import Faults
from tests.faults.scenarios import gone_sites, kill_client_job, kill_server_job, kill_trainer

S = JobStatus


@pytest.mark.parametrize("state", [S.DISPATCHED, S.RUNNING], ids=["dispatched", "running"])
def test_a_killed_server_job_ends_its_job(faults: Faults, state: JobStatus) -> None:
    trial = kill_server_job(faults, state)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
    [job_id] = trial.expect
    record = faults.system.job(job_id)
    if record.status is S.FINISHED_ABNORMAL:
        assert "server job ended without reporting" in record.status_reason, record.status_reason


@pytest.mark.parametrize("after_heartbeat", [False, True],
                         ids=["before-first-heartbeat", "after-first-heartbeat"])
@pytest.mark.parametrize("state", [S.DISPATCHED, S.RUNNING], ids=["dispatched", "running"])
def test_a_killed_client_job_is_acted_on_by_the_runner(
    faults: Faults, state: JobStatus, after_heartbeat: bool,
) -> None:
    trial = kill_client_job(faults, state, after_heartbeat=after_heartbeat)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
    [job_id] = trial.expect
    if outcome.statuses[job_id] is S.FINISHED_COMPLETED:  # Watch: told the site is gone
        site = faults.agents[0].site
        gone = gone_sites(faults, job_id)
        assert list(gone) == [site], gone
        # its agent's ended notice, or its heartbeat no longer listing the job: whichever the
        # runner saw first
        assert "killed by signal 9" in gone[site] or gone[site] == NOT_RUNNING, gone


def test_a_killed_trainer_fails_the_task_and_the_job(faults: Faults) -> None:
    trial = kill_trainer(faults)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
    [job_id] = trial.expect
    assert faults.agents[0].site in faults.system.job(job_id).status_reason
