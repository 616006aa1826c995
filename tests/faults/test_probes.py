"""Issue #16 point 1 against the running system: a site's own broker credentials reach nothing
but its own work, and the services' consumers refuse what any other broker user sends them."""

from __future__ import annotations

from fedhive.jobs.status import JobStatus
from tests.faults.harness import Faults
from tests.faults.probes import rogue_probes, site_probes
from tests.faults.scenarios import HOLD

S = JobStatus


def test_a_sites_credentials_reach_nothing_but_its_own_work(faults: Faults) -> None:
    results = site_probes(faults)
    assert len(results) >= 60
    assert [f"{r.name}: {r.outcome}" for r in results if r.allowed] == []


def test_the_services_refuse_a_broker_user_that_is_not_theirs(faults: Faults,
                                                               rogue_url: str) -> None:
    trial = faults.begin("rogue broker user")
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    results = rogue_probes(faults, rogue_url, job_id)
    assert [f"{r.name}: {r.outcome}" for r in results if r.allowed] == []
    outcomes = {r.name: r.outcome for r in results}
    for service in ("list jobs at the job-store", "abort a job at the job-runner"):
        assert outcomes[f"rogue: {service}"].startswith("PERMISSION_DENIED"), outcomes
    assert faults.status(job_id) is S.RUNNING  # the forged abort, delete and dispatch did nothing
    faults.go(job_id)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
