"""Two upper tiers sharing one lower tier (seed 004's "multiple hierarchies"): roots R1 and R2,
each with an ordinary site and a hub site for tier 2; tier 2 (two sites) runs both roots' jobs
side by side, three real systems on one broker, Redis and S3. Each hub holds a `lead` token of
tier 2 (the least a hub needs: it submits, manages its own jobs and views), a different lead
per root: neither root's credentials reach the other's job below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhive.errors import PermissionDenied
from fedhive.jobs.status import JobStatus
from fedhive.jobs.tiers import HIERARCHY
from fedhive.sdk.operations import end_request
from tests.fixtures.e2e import SCHEDULER_OPTIONS, running_system
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
LEADS = {1: "lead@a", 2: "lead@b"}  # each root's hub's admin at tier 2 (orgs a and b)
# Tier 2 runs both roots' jobs at once.
TWO_AT_ONCE = ("--max-jobs", "2",
               *SCHEDULER_OPTIONS[SCHEDULER_OPTIONS.index("--max-schedule-count"):])


def test_two_roots_share_a_lower_tier_and_neither_reaches_the_others_job(
        amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    tmp = tmp_path_factory.mktemp("two-roots")
    names = {n: f"t{RUN_ID}-2r{n}" for n in ("r1", "r2", "low")}
    settings = {n: settings_for(amqp_url, redis_url, s3_server, f"{test_bucket}-2r{n}", names[n])
                for n in names}
    lower_sites = [f"l{RUN_ID}-1", f"l{RUN_ID}-2"]
    roots = {1: [f"p{RUN_ID}-1", f"hp{RUN_ID}"], 2: [f"q{RUN_ID}-1", f"hq{RUN_ID}"]}
    for n in names:
        (tmp / n).mkdir()
    with running_system(settings["low"], tmp / "low", lower_sites, schedulers=1,
                        scheduler_options=TWO_AT_ONCE) as low, \
            running_system(settings["r1"], tmp / "r1", roots[1], launched=1,
                           schedulers=1) as r1, \
            running_system(settings["r2"], tmp / "r2", roots[2], launched=1,
                           schedulers=1) as r2:
        lower = Tier(low, start_gateway(low, tmp / "low"))
        tops = {1: Tier(r1, start_gateway(r1, tmp / "r1")),
                2: Tier(r2, start_gateway(r2, tmp / "r2"))}
        try:
            for n, top in tops.items():
                configure_hub(top.system.agents[1], top.system, lower, admin=LEADS[n])
            trainers = [roots[1][0], roots[2][0], *lower_sites]
            offsets = dict(zip(trainers, (1.0, 2.0, 3.0, 7.0), strict=True))
            weights = dict(zip(trainers, (1.0, 2.0, 1.0, 4.0), strict=True))
            initial = {"w": np.linspace(0, 1, 5, dtype=np.float32)}
            app = site_app(tmp_path / "app", offsets, weights, seconds=0.2)
            jobs = {}
            for n, top in tops.items():
                job = sag_job(tmp_path / f"root-{n}", app, min_clients=2, num_rounds=2,
                              initial=initial)
                with top.session() as session:
                    jobs[n] = session.submit(job).job_id

            for n, top in tops.items():
                record = top.system.wait_final(jobs[n], timeout=240)
                assert record.status is S.FINISHED_COMPLETED, record.status_reason
                expected = {"w": initial["w"].astype(np.float64)}
                for _ in range(2):
                    expected = fedavg(expected, [roots[n][0], *lower_sites], offsets, weights)
                np.testing.assert_allclose(model_of(top, jobs[n], tmp_path)["w"],
                                           expected["w"], rtol=1e-6)
                below = low.wait_final(jobs[n], timeout=60)
                assert below.status is S.FINISHED_COMPLETED, below.status_reason
                assert below.submitter.name == LEADS[n]
                assert below.meta.extra[HIERARCHY] == {"tier": 2, "parent_job_id": jobs[n],
                                                       "hub_site": roots[n][1]}

            # R1's hub token at tier 2 cannot operate, abort or delete R2's job there.
            with lower.gateway.session(LEADS[1]) as session:
                for attempt in (lambda: session.run_operation(end_request(jobs[2])),
                                lambda: session.abort(jobs[2], "not yours"),
                                lambda: session.delete(jobs[2])):
                    with pytest.raises(PermissionDenied):
                        attempt()
            with lower.gateway.session(LEADS[2]) as session:
                assert session.get(jobs[2]).status is S.FINISHED_COMPLETED  # still there
        finally:
            for tier in (lower, *tops.values()):
                tier.gateway.stop()
