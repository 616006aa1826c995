"""Three tiers end to end (seed 004: "this scheme can repeat"): tier 1 (an ordinary site and a
hub) -> tier 2 (an ordinary site and a hub) -> tier 3 (two sites), three real systems on one
broker, Redis and S3, each with its services, gateway and site agents. FedAvg over the tiers
equals FedAvg over the four training sites flat; every tier ran the job under the root's id.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhive.jobs.status import JobStatus
from fedhive.jobs.tiers import HIERARCHY
from tests.fixtures.e2e import running_system
from tests.fixtures.infra import RUN_ID, S3Server, settings_for
from tests.fixtures.tiers import (
    Tier,
    configure_hub,
    fedavg,
    model_of,
    sag_job,
    site_app,
    start_gateway,
)

S = JobStatus


def test_fedavg_over_three_tiers_equals_the_flat_run(
        amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    tmp = tmp_path_factory.mktemp("three-tiers")
    names = {n: f"t{RUN_ID}-3t{n}" for n in (1, 2, 3)}
    settings = {n: settings_for(amqp_url, redis_url, s3_server,
                                test_bucket if n == 1 else f"{test_bucket}-3t{n}", names[n])
                for n in (1, 2, 3)}
    sites = {1: [f"x{RUN_ID}-1", f"hx{RUN_ID}"], 2: [f"y{RUN_ID}-1", f"hy{RUN_ID}"],
             3: [f"z{RUN_ID}-1", f"z{RUN_ID}-2"]}
    for n in (1, 2, 3):
        (tmp / str(n)).mkdir()
    with running_system(settings[3], tmp / "3", sites[3], schedulers=1) as s3, \
            running_system(settings[2], tmp / "2", sites[2], launched=1, schedulers=1) as s2, \
            running_system(settings[1], tmp / "1", sites[1], launched=1, schedulers=1) as s1:
        tiers = {n: Tier(system, start_gateway(system, tmp / str(n)))
                 for n, system in ((1, s1), (2, s2), (3, s3))}
        try:
            configure_hub(s2.agents[1], s2, tiers[3])
            configure_hub(s1.agents[1], s1, tiers[2])
            trainers = [sites[1][0], sites[2][0], *sites[3]]
            offsets = dict(zip(trainers, (1.0, 2.0, 3.0, 7.0), strict=True))
            weights = dict(zip(trainers, (1.0, 2.0, 1.0, 4.0), strict=True))
            initial = {"w": np.linspace(0, 1, 5, dtype=np.float32)}
            job = sag_job(tmp_path / "three", site_app(tmp_path / "app", offsets, weights),
                          min_clients=2, num_rounds=2, initial=initial)
            with tiers[1].session() as session:
                job_id = session.submit(job).job_id
            record = s1.wait_final(job_id, timeout=240)
            assert record.status is S.FINISHED_COMPLETED, record.status_reason

            expected = {"w": initial["w"].astype(np.float64)}
            for _ in range(2):
                expected = fedavg(expected, trainers, offsets, weights)
            np.testing.assert_allclose(model_of(tiers[1], job_id, tmp_path)["w"],
                                       expected["w"], rtol=1e-6)
            for n, hub in ((2, sites[1][1]), (3, sites[2][1])):
                lower = tiers[n].system.wait_final(job_id, timeout=60)
                assert lower.status is S.FINISHED_COMPLETED, lower.status_reason
                assert lower.meta.extra[HIERARCHY] == {"tier": n, "parent_job_id": job_id,
                                                       "hub_site": hub}
        finally:
            for tier in tiers.values():
                tier.gateway.stop()
