"""Two job-runners (the same id: the second refuses to start; different ids: both run, no job
runs twice), a runner cut from Redis at the worst moment, and a whole site frozen past its
heartbeat timeout, then resumed."""

from __future__ import annotations

from fedhive_services.job_runner.liveness import OFFLINE, SILENT
from tests.faults.harness import Faults
from tests.faults.scenarios import (
    cut_redis_as_a_job_starts,
    freeze_site,
    gone_sites,
    second_runner_same_id,
    two_runners,
)


def test_a_second_runner_with_the_same_id_refuses_to_start(faults: Faults) -> None:
    outcome = faults.verify(second_runner_same_id(faults))
    assert outcome.ok, outcome.describe()


def test_two_runners_with_their_own_ids_share_the_jobs_and_run_none_twice(
    faults: Faults,
) -> None:
    outcome = faults.verify(two_runners(faults, jobs=4))
    assert outcome.ok, outcome.describe()


def test_a_frozen_site_is_judged_gone_and_ends_its_part_once_resumed(faults: Faults) -> None:
    trial = freeze_site(faults)
    outcome = faults.verify(trial)
    assert outcome.ok, outcome.describe()
    [job_id] = trial.expect
    site = faults.agents[0].site
    gone = gone_sites(faults, job_id)
    assert list(gone) == [site] and gone[site] in (OFFLINE, SILENT), gone  # whichever came first


def test_a_runner_cut_from_redis_as_a_job_turns_running_still_ends_the_job(
    faults: Faults,
) -> None:
    """Its writes right after DISPATCHED -> RUNNING fail: the job must still be watched to its
    end (and the one slot freed for the next job)."""
    outcome = faults.verify(cut_redis_as_a_job_starts(faults), wait_s=30)
    assert outcome.ok, outcome.describe()
