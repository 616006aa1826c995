"""FLARE-format jobs run unchanged, or are refused at submission, never at start.

The jobs of tests/fixtures/flare_jobs/ (meta.conf + HOCON configs, YAML, a `{"sites": ...}`
deploy_map; FLARE's own component paths) are zipped as FLARE's client zips a job folder and
submitted as they are to one real system (job-store, schedulers, job-runner with server jobs,
two site agents named `site-1` and `site-2` as the jobs name them: tests/fixtures/e2e.py),
and each ends FINISHED:COMPLETED with FLARE's results; the broken ones are refused at submit
with the same one line `fedhive validate` prints.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from tests.fixtures.e2e import System, running_system
from tests.fixtures.infra import RUN_ID, S3Server, settings_for
from tests.unit.test_flare_jobs import BROKEN, JOBS
from tests.unit.test_jobs_validation import zip_folder

S = JobStatus
SITES = ["site-1", "site-2"]  # as the jobs name them (cyclic-sites-map's deploy_map)


@pytest.fixture(scope="module")
def system(amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    settings = settings_for(amqp_url, redis_url, s3_server, test_bucket, f"t{RUN_ID}-flare")
    with running_system(settings, tmp_path_factory.mktemp("flare"), SITES) as running:
        yield running


def run(system: System, name: str) -> tuple[JobRecord, dict[str, bytes]]:
    job_id = system.submit(zip_folder(JOBS / name, top=name))
    record = system.wait_status(job_id, S.FINISHED_COMPLETED, timeout=180)
    return record, system.result(record)


def model(result: dict[str, bytes], name: str = "models/server.npy") -> np.ndarray[Any, Any]:
    with np.load(io.BytesIO(result[name])) as arrays:
        return np.asarray(arrays["numpy_key"])


def rounds(result: dict[str, bytes]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(result["metrics.json"])["rounds"]
    return entries


def test_hello_numpy_with_hocon_files_and_flare_paths(system: System) -> None:
    record, result = run(system, "hello-numpy-sag")
    assert record.meta.name == "hello-numpy-sag" and record.sites == SITES
    start = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)
    assert np.array_equal(model(result), start + 3)  # 3 rounds, each site adds 1
    train = [r for r in rounds(result) if r["workflow"] == "ScatterAndGather"]
    assert [r["round"] for r in train] == [0, 1, 2]
    table = json.loads(next(data for name, data in result.items()
                            if name.endswith("cross_val_results.json")))
    assert set(table) == {*SITES, "SRV_persistor"}
    assert table["SRV_persistor"]["site-1"]["weight_mean"] == pytest.approx(8.0)
    stored = zipfile.ZipFile(io.BytesIO(system.blobs.get(record.archive_key))).namelist()
    assert "meta.json" in stored and "meta.conf" not in stored
    assert "app/config/config_fed_server.conf" in stored  # the configs as written


def test_fedavg_with_yaml_files_and_the_client_api_launcher(system: System) -> None:
    _, result = run(system, "fedavg-yaml")
    start = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)
    assert np.array_equal(model(result), start + 3)
    assert [r["round"] for r in rounds(result)] == [0, 1, 2]
    assert rounds(result)[-1]["metrics"]["aggregate"]["weight_mean"] == pytest.approx(8.0)


def test_a_sites_deploy_map_with_resource_spec_default_and_in_process_client_api(
        system: System) -> None:
    record, result = run(system, "cyclic-sites-map")
    assert record.meta.deploy_map == {"server_app": ["server"], "site_app": SITES}
    assert record.meta.resource_spec == {"site-1": {"gpu": 1}, "site-2": {"gpu": 1}}
    assert record.sites == SITES
    assert np.array_equal(model(result), np.full((2, 2), 8.0, dtype=np.float32))  # 2 x 2 x 2.0


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_flare_jobs_are_refused_at_submit(system: System, name: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        system.submit(zip_folder(JOBS / "broken" / name, top=name))
    assert caught.value.message == BROKEN[name]
