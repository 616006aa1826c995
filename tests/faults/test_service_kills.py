"""SIGKILL of each service (job-store, scheduler, job-runner, site agent) while a job is
SUBMITTED, DISPATCHED or RUNNING, then a restart: every job completes exactly once, no site is
judged gone (a restarted agent re-adopts its client jobs), nothing is left behind."""

from __future__ import annotations

import pytest

from fedhive.jobs.status import JobStatus
from tests.faults.harness import SERVICES, Faults
from tests.faults.scenarios import STATES, kill_service


@pytest.mark.parametrize("state", STATES, ids=lambda state: state.value.lower())
@pytest.mark.parametrize("service", SERVICES)
def test_a_killed_service_restarts_and_every_job_completes_once(
    faults: Faults, service: str, state: JobStatus,
) -> None:
    outcome = faults.verify(kill_service(faults, service, state))
    assert outcome.ok, outcome.describe()
