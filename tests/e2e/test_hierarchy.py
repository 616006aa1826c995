"""Hierarchical federation end to end (seed 004): two real fedhive systems on one broker, Redis
and S3 (namespaces of their own, buckets of their own), each with its services, gateway and
site agents. Tier 1 has an ordinary site and a hub site whose lower tier is tier 2 (two sites).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from fedhive.config import Settings
from fedhive.jobs.status import JobStatus
from fedhive.jobs.tiers import HIERARCHY
from tests.fixtures.e2e import SCHEDULER_OPTIONS, running_system
from tests.fixtures.infra import RUN_ID, S3Server, settings_for, wait_for
from tests.fixtures.site_agent import SiteAgentProcess, agent_env
from tests.fixtures.tiers import (
    ADMIN,
    Tier,
    configure_hub,
    fedavg,
    lower_running,
    model_of,
    result_file,
    sag_job,
    site_app,
    start_gateway,
)

S = JobStatus
STORED_FROM = 4096  # bytes: the tiers' inline threshold
# Tier 1's runner waits this long for a silent site: a restarted hub agent re-attaches in time.
RESTART_TOLERANT = ("--site-ttl", "15", "--job-ttl", "15")
# Tier 2's scheduler gives a job it cannot schedule up after 3 tries (not 20), and runs up to
# 4 jobs at once (a job still ending never holds the next one back).
QUICK_TO_GIVE_UP = ("--max-jobs", "4", "--max-schedule-count", "3",
                    *SCHEDULER_OPTIONS[SCHEDULER_OPTIONS.index("--min-schedule-interval"):])


@dataclass
class Tiers:
    t1: Tier
    t2: Tier
    hub: SiteAgentProcess

    @property
    def plain(self) -> str:
        return self.t1.system.sites[0]

    def configure_hub(self, **fields: object) -> None:
        configure_hub(self.hub, self.t1.system, self.t2, **fields)

    def uniform_job(self, tmp: Path, name: str, rounds: int, seconds: float = 0.0) -> Path:
        """A job whose sites (both tiers') each add 1 and weigh 1, taking `seconds`."""
        sites = [self.plain, *self.t2.system.sites]
        app = site_app(tmp / "app", dict.fromkeys(sites, 1.0), dict.fromkeys(sites, 1.0),
                       seconds=seconds)
        return sag_job(tmp / name, app, min_clients=2, num_rounds=rounds,
                       initial={"w": np.zeros(2, np.float32)})


@pytest.fixture(scope="module")
def tiers(amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiers]:
    tmp = tmp_path_factory.mktemp("tiers")
    (tmp / "t1").mkdir()
    (tmp / "t2").mkdir()
    # Arrays over 4 KiB are stored objects (refs across tiers, exports), smaller ones inline.
    settings2 = replace(settings_for(amqp_url, redis_url, s3_server, f"{test_bucket}-t2",
                                     f"t{RUN_ID}-t2"), inline_threshold=STORED_FROM)
    settings1: Settings = replace(settings_for(amqp_url, redis_url, s3_server, test_bucket,
                                               f"t{RUN_ID}-t1"), inline_threshold=STORED_FROM)
    sites2 = [f"b{RUN_ID}-1", f"b{RUN_ID}-2"]
    sites1 = [f"a{RUN_ID}-1", f"hub{RUN_ID}"]
    with running_system(settings2, tmp / "t2", sites2, schedulers=1,
                        scheduler_options=QUICK_TO_GIVE_UP) as t2, \
            running_system(settings1, tmp / "t1", sites1, launched=1, schedulers=1,
                           runner_args=RESTART_TOLERANT) as t1:
        gateways = [start_gateway(t2, tmp / "t2"), start_gateway(t1, tmp / "t1")]
        try:
            found = Tiers(Tier(t1, gateways[1]), Tier(t2, gateways[0]), t1.agents[1])
            found.configure_hub()
            yield found
        finally:
            for gateway in gateways:
                gateway.stop()


def test_two_tier_fedavg_equals_the_flat_run_over_the_same_sites(
        tiers: Tiers, tmp_path: Path) -> None:
    plain, (b1, b2) = tiers.plain, tiers.t2.system.sites
    offsets = {plain: 1.0, b1: 2.0, b2: 5.0}
    weights = {plain: 2.0, b1: 1.0, b2: 3.0}
    # "big" travels as refs: tier 1's URLs down to tier 2's sites, tier 2's aggregate copied
    # up into tier 1's store by tier 2's server job (ExportOperationResult)
    initial = {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
               "big": np.linspace(0, 1, STORED_FROM // 2, dtype=np.float32)}
    app = site_app(tmp_path / "site-app", offsets, weights)
    job = sag_job(tmp_path / "two-tier", app, min_clients=2, num_rounds=3, initial=initial)
    with tiers.t1.session() as session:
        job_id = session.submit(job).job_id
    record = tiers.t1.system.wait_final(job_id, timeout=180)
    assert record.status is S.FINISHED_COMPLETED, (
        f"{record.status_reason}\n{tiers.t1.system.runner.log()}\n{tiers.hub.log()}")

    expected = {name: value.astype(np.float64) for name, value in initial.items()}
    for _ in range(3):
        expected = fedavg(expected, [plain, b1, b2], offsets, weights)
    model = model_of(tiers.t1, job_id, tmp_path)
    for name in initial:
        np.testing.assert_allclose(model[name], expected[name], rtol=1e-6)

    # The lower tier ran the job under the same id, as an operation-driven job, and ended it.
    lower = tiers.t2.system.wait_final(job_id, timeout=60)
    assert lower.status is S.FINISHED_COMPLETED, lower.status_reason
    log = result_file(tiers.t2, job_id, tmp_path, "server_job.log").decode()
    assert log.count('"operation.exported"') == 3  # "big" copied up each round
    assert lower.meta.extra[HIERARCHY] == {"tier": 2, "parent_job_id": job_id,
                                           "hub_site": tiers.hub.site}
    with tiers.t2.session() as session:
        rounds = session.metrics(job_id)
    assert [r.round for r in rounds] == [0, 1, 2]
    assert all(set(r.metrics["sites"]) == {b1, b2} for r in rounds)
    with tiers.t1.session() as session:
        top = session.metrics(job_id)
    assert all(set(r.metrics["sites"]) == {plain, tiers.hub.site} for r in top)


def test_a_project_prefixed_relay_operator_configures_the_lower_tier_only(
        tiers: Tiers, tmp_path: Path) -> None:
    """`BC.train` (the lower tier's project is BC) makes tier 2 relay while tier 1 broadcasts:
    the hub's result is the model passed through both tier-2 sites in turn."""
    plain, (b1, b2) = tiers.plain, tiers.t2.system.sites
    offsets = {plain: 1.0, b1: 2.0, b2: 5.0}
    weights = {plain: 1.0, b1: 1.0, b2: 1.0}
    tiers.configure_hub(project="BC", sites=[b1, b2])
    try:
        operators = {"train": {"method": "bcast", "min_targets": 2},
                     "BC.train": {"method": "relay", "targets": [b1, b2]}}
        job = sag_job(tmp_path / "relay", site_app(tmp_path / "app", offsets, weights),
                      min_clients=2, num_rounds=1, initial={"w": np.zeros(4, np.float32)},
                      operators=operators)
        with tiers.t1.session() as session:
            job_id = session.submit(job).job_id
        record = tiers.t1.system.wait_final(job_id, timeout=180)
        assert record.status is S.FINISHED_COMPLETED, record.status_reason
    finally:
        tiers.configure_hub()
    # plain: 0 + 1 (weight 1); the hub: 0 + 2 + 5 in turn, weighing its two relayed steps (2)
    expected = (1.0 * 1 + 7.0 * 2) / 3
    np.testing.assert_allclose(model_of(tiers.t1, job_id, tmp_path)["w"], np.full(4, expected),
                               rtol=1e-6)


def test_an_abort_at_the_root_stops_the_lower_tier(tiers: Tiers, tmp_path: Path) -> None:
    job = tiers.uniform_job(tmp_path, "slow", rounds=50, seconds=2.0)
    with tiers.t1.session() as session:
        job_id = session.submit(job).job_id
        lower_running(tiers.t2, job_id)
        session.abort(job_id, "enough")
    assert tiers.t1.system.wait_final(job_id, timeout=60).status is S.FINISHED_ABORTED
    lower = tiers.t2.system.wait_final(job_id, timeout=60)
    assert lower.status is S.FINISHED_ABORTED
    assert "the upper tier aborted it" in lower.status_reason
    wait_for(lambda: tiers.t2.system.freed(job_id), timeout=60, what="tier 2 sites freed")


def test_a_lower_tier_that_cannot_schedule_the_job_fails_its_task_with_its_reason(
        tiers: Tiers, tmp_path: Path) -> None:
    tiers.configure_hub(resource_spec={tiers.t2.system.sites[0]: {"num_of_gpus": 64}})
    try:
        job = tiers.uniform_job(tmp_path, "greedy", rounds=1)
        with tiers.t1.session() as session:
            job_id = session.submit(job).job_id
        record = tiers.t1.system.wait_final(job_id, timeout=120)
    finally:
        tiers.configure_hub()
    assert record.status is S.FINISHED_EXECUTION_EXCEPTION, record.status_reason
    assert f"the result of {tiers.hub.site} is an error" in record.status_reason
    assert f"job {job_id} is FINISHED:CAN_NOT_SCHEDULE" in record.status_reason
    assert "gpu" in record.status_reason.lower()


def test_a_hub_agent_killed_mid_job_reattaches_and_the_job_completes_once(
        tiers: Tiers, tmp_path: Path) -> None:
    job = tiers.uniform_job(tmp_path, "restart", rounds=4, seconds=1.0)
    with tiers.t1.session() as session:
        job_id = session.submit(job).job_id
        lower_running(tiers.t2, job_id)
        tiers.hub.kill()
        tiers.hub.launch()
        record = tiers.t1.system.wait_final(job_id, timeout=180)
        assert record.status is S.FINISHED_COMPLETED, record.status_reason
    with tiers.t2.session() as session:
        made = [job for job in session.list() if job.meta.extra.get(HIERARCHY, {})
                .get("parent_job_id") == job_id]
    assert [job.job_id for job in made] == [job_id]
    assert tiers.t2.system.wait_final(job_id, timeout=60).status is S.FINISHED_COMPLETED
    np.testing.assert_allclose(model_of(tiers.t1, job_id, tmp_path)["w"], np.full(2, 4.0))


@pytest.mark.parametrize("change, message", [
    ({"gateway": "127.0.0.1:1"}, "the lower tier's gateway 127.0.0.1:1"),
    ({"token_file": "wrong-token"}, "the lower tier's gateway"),
    ({"sites": ["no-such-site"]}, "the lower tier has no site 'no-such-site'"),
])
def test_a_bad_hub_configuration_stops_the_agent_at_start_with_one_line(
        tiers: Tiers, tmp_path: Path, change: dict[str, object], message: str) -> None:
    site_dir = tmp_path / "hub-site"
    (site_dir / "local").mkdir(parents=True)
    for name in ("site.json", "resources.json"):
        (site_dir / "local" / name).write_text((tiers.hub.site_dir / "local" / name).read_text())
    (site_dir / "local" / "t2-token").write_text(tiers.t2.gateway.admins.tokens[ADMIN])
    (site_dir / "local" / "wrong-token").write_text("not-a-token")
    config = {"gateway": tiers.t2.gateway.address, "token_file": "t2-token", **change}
    (site_dir / "local" / "hub.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "fedhive_services.site_agent.main", "run", "--site-dir",
         str(site_dir)], capture_output=True, text=True, timeout=60, env=agent_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
    assert "Traceback" not in done.stderr
