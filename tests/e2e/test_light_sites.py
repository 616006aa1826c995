"""Light sites through the whole system: the real services, and four sites hosted by one
`fedhive-site-agent host` process, each its own broker user. A federated job runs on all of
them as on site agents; a site whose code raises fails it as it would anywhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedhive.jobs.definition import load_job
from fedhive.jobs.status import JobStatus
from tests.fixtures.e2e import System, running_system
from tests.fixtures.fl_jobs import sag_job
from tests.fixtures.infra import RUN_ID, S3Server, settings_for
from tests.fixtures.simulate import rounds

SITES = [f"l{RUN_ID}-{n}" for n in range(1, 5)]


@pytest.fixture(scope="module")
def light_system(amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    settings = settings_for(amqp_url, redis_url, s3_server, test_bucket, f"t{RUN_ID}-light")
    with running_system(settings, tmp_path_factory.mktemp("light"), SITES,
                        launched=len(SITES), light=True) as system:
        yield system


def test_a_job_runs_on_every_light_site(light_system: System, tmp_path: Path) -> None:
    job = sag_job(tmp_path, "light", sites=SITES, min_clients=len(SITES), num_rounds=3)
    job_id = light_system.submit(load_job(job).to_zip() or b"")
    record = light_system.wait_final(job_id, timeout=90)
    assert record.status is JobStatus.FINISHED_COMPLETED, record.status_reason
    reports = rounds(light_system.result(record))
    assert [r["round"] for r in reports] == [0, 1, 2]
    assert all(set(r["metrics"]["sites"]) == set(SITES) for r in reports)


def test_a_light_site_whose_code_raises_fails_the_job_naming_it(light_system: System,
                                                                tmp_path: Path) -> None:
    job = sag_job(tmp_path, "failing", sites=SITES, min_clients=len(SITES),
                  ignore_result_error=False, fail_sites=(SITES[2],))
    record = light_system.wait_final(light_system.submit(load_job(job).to_zip() or b""),
                                     timeout=90)
    assert record.status is JobStatus.FINISHED_EXECUTION_EXCEPTION
    assert SITES[2] in record.status_reason and "no data at" in record.status_reason
