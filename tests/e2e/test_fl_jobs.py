"""Federated jobs end to end: the examples and FL edge cases through the real `fedhive` CLI,
gateway, job-store, schedulers, job-runner (server jobs) and site agents (client jobs) on their
own broker users, over real RabbitMQ, Redis and S3 (tests/fixtures/e2e.py).

The system is shared by the module: each test leaves every job it made final.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedhive.jobs.metrics import RoundMetrics
from fedhive.jobs.status import JobStatus
from fedhive.sdk import Session
from tests.fixtures.bus import Broker
from tests.fixtures.cli import Cli as BaseCli
from tests.fixtures.cli import cli_for
from tests.fixtures.e2e import System
from tests.fixtures.fl_jobs import sag_job
from tests.fixtures.infra import wait_for
from tests.fixtures.simulate import simulate

S = JobStatus
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Cli(BaseCli):
    def submit(self, folder: Path) -> str:
        job_id: str = self.json("submit", str(folder))["id"]
        return job_id

    def watch(self, job_id: str) -> dict[str, Any]:
        """`fedhive watch` until the job is final; its last line (exit 0 only for a job that
        completed)."""
        done = self.run("watch", job_id, "--json", check=False)
        last: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        assert done.returncode == (0 if last["status"] == "FINISHED:COMPLETED" else 1), done.stderr
        return last

    def result(self, job_id: str, out: Path) -> dict[str, bytes]:
        self.json("download", job_id, "-o", str(out))
        with zipfile.ZipFile(out / job_id / "result.zip") as archive:
            return {name: archive.read(name) for name in archive.namelist()}


@pytest.fixture(scope="module")
def cli(e2e_system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with cli_for(e2e_system.settings, tmp_path_factory.mktemp("fl-cli"), Cli) as cli:
        yield cli


def rounds(result: dict[str, bytes]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = json.loads(result["metrics.json"])["rounds"]
    return entries


def completed(cli: Cli, system: System, job_id: str) -> dict[str, Any]:
    last = cli.watch(job_id)
    assert last["status"] == S.FINISHED_COMPLETED.value, (
        f"{last['status']}: {last.get('status_reason')}\n{system.runner.log()}")
    return last


def assert_simulated_alike(folder: Path, sites: list[str], deployed: dict[str, bytes],
                           tmp_path: Path) -> dict[str, Any]:
    """`fedhive simulate` of the job on sites of the same names gives the deployment's result:
    the same files, the same arrays, the same rounds (but their times); the simulated job."""
    job, simulated = simulate(folder, tmp_path / "simulated", "--sites", ",".join(sites))
    assert sorted(simulated) == sorted(deployed)
    for name, data in simulated.items():
        if name.endswith(".log"):
            continue
        if name.endswith(".npz"):
            with np.load(io.BytesIO(data)) as ours, np.load(io.BytesIO(deployed[name])) as theirs:
                assert sorted(ours) == sorted(theirs), name
                for key in ours:
                    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=name)
        elif name == "metrics.json":
            assert [{**r, "time": 0} for r in rounds(simulated)] == [
                {**r, "time": 0} for r in rounds(deployed)]
        else:
            assert data == deployed[name], name
    return job


def test_hello_numpy(cli: Cli, e2e_system: System, tmp_path: Path) -> None:
    job_id = cli.submit(EXAMPLES / "hello-numpy")
    completed(cli, e2e_system, job_id)
    result = cli.result(job_id, tmp_path)
    assert_simulated_alike(EXAMPLES / "hello-numpy", e2e_system.sites[:2], result, tmp_path)
    reports = rounds(result)
    assert [r["round"] for r in reports] == list(range(reports[0]["num_rounds"]))
    assert set(reports[-1]["metrics"]["sites"]) == set(e2e_system.sites[:2])
    assert any(name.endswith(".npz") for name in result)
    queues, _ = Broker(e2e_system.settings.amqp_url, e2e_system.settings.namespace).declared()
    task_queue = e2e_system.names.job_server_queue(job_id)
    assert not [q for q in queues if q.startswith(task_queue)], "the job's task queue is left"

    # `fedhive metrics`: the rounds the server job logged in Redis are the result's rounds
    shown = cli.json("metrics", job_id)
    assert shown["id"] == job_id and len(shown["rounds"]) == len(reports)
    for entry, kept in zip(shown["rounds"], reports, strict=True):
        assert (entry["workflow"], entry["round"], entry["num_rounds"]) == (
            kept["workflow"], kept["round"], kept["num_rounds"])
        assert entry["aggregate"] == kept["metrics"]["aggregate"]
        assert entry["sites"] == kept["metrics"]["sites"]
    picture = tmp_path / "curve.png"
    assert f"Plot written to {picture}" in cli.run("metrics", job_id, "--plot",
                                                   str(picture)).stdout
    assert picture.read_bytes().startswith(b"\x89PNG")
    with Session(cli.gateway.address, cli.gateway.admins.tokens["lead@a"]) as session:
        listed = session.metrics(job_id)
    assert all(isinstance(r, RoundMetrics) and r.at_ms > 0 for r in listed)
    assert [r.round for r in listed] == [r["round"] for r in reports]


def test_hello_pt_reaches_the_accuracy_goal(cli: Cli, e2e_system: System,
                                           tmp_path: Path) -> None:
    job_id = cli.submit(EXAMPLES / "hello-pt")
    completed(cli, e2e_system, job_id)
    result = cli.result(job_id, tmp_path)
    assert rounds(result)[-1]["metrics"]["aggregate"]["accuracy"] >= 0.90
    assert any(name.endswith(".pt") for name in result)
    # simulated, the same training on the same shards: the same rounds (torch on CPU may
    # order a float sum differently from run to run: equal to float tolerance)
    _, simulated = simulate(EXAMPLES / "hello-pt", tmp_path / "simulated", "--sites",
                            ",".join(e2e_system.sites[:2]))
    assert sorted(simulated) == sorted(result)
    for ours, theirs in zip(rounds(simulated), rounds(result), strict=True):
        for site, metrics in theirs["metrics"]["sites"].items():
            assert ours["metrics"]["sites"][site] == pytest.approx(metrics, rel=1e-4), site


def test_cyclic_numpy(cli: Cli, e2e_system: System, tmp_path: Path) -> None:
    job_id = cli.submit(EXAMPLES / "cyclic-numpy")
    completed(cli, e2e_system, job_id)
    result = cli.result(job_id, tmp_path)
    assert rounds(result)
    assert_simulated_alike(EXAMPLES / "cyclic-numpy", e2e_system.sites[:2], result, tmp_path)


def test_cross_site_eval(cli: Cli, e2e_system: System, tmp_path: Path) -> None:
    job_id = cli.submit(EXAMPLES / "cross-site-eval")
    completed(cli, e2e_system, job_id)
    result = cli.result(job_id, tmp_path)
    table = json.loads(next(data for name, data in result.items()
                            if name.endswith("cross_val_results.json")))
    sites = set(e2e_system.sites[:2])
    assert sites <= set(table)
    for validators in table.values():
        assert set(validators) == sites
        assert all("accuracy" in metrics for metrics in validators.values())
    assert_simulated_alike(EXAMPLES / "cross-site-eval", e2e_system.sites[:2], result, tmp_path)


def test_an_executor_error_fails_the_job_unless_ignored(cli: Cli, e2e_system: System,
                                                       tmp_path: Path) -> None:
    sites = e2e_system.sites[:2]
    # min_clients 2: an error result counts as a response, so both sites are waited for
    strict = cli.submit(sag_job(tmp_path, "strict", sites=sites, min_clients=2,
                                ignore_result_error=False, fail_sites=(sites[1],)))
    last = cli.watch(strict)
    assert last["status"] == S.FINISHED_EXECUTION_EXCEPTION.value
    assert sites[1] in last["status_reason"] and "no data at" in last["status_reason"]
    simulated, _ = simulate(tmp_path / "strict", tmp_path / "simulated", "--sites",
                            ",".join(sites))
    assert (simulated["status"], simulated["status_reason"]) == (
        last["status"], last["status_reason"])

    lenient = cli.submit(sag_job(tmp_path, "lenient", sites=sites, min_clients=2,
                                 ignore_result_error=True, fail_sites=(sites[1],)))
    completed(cli, e2e_system, lenient)
    reports = rounds(cli.result(lenient, tmp_path))
    assert all(set(r["metrics"]["sites"]) == {sites[0]} for r in reports)


def test_a_bad_component_reference_fails_at_start_naming_it(cli: Cli, e2e_system: System,
                                                           tmp_path: Path) -> None:
    folder = sag_job(tmp_path, "bad-ref", sites=e2e_system.sites[:2], min_clients=1)
    config = folder / "app" / "config" / "config_fed_server.json"
    server = json.loads(config.read_text())
    server["workflows"][0]["args"]["aggregator_id"] = "persistor"
    config.write_text(json.dumps(server))
    last = cli.watch(cli.submit(folder))
    assert last["status"] == S.FINISHED_EXECUTION_EXCEPTION.value
    assert "'persistor'" in last["status_reason"] and "aggregator_id" in last["status_reason"]


def test_a_site_killed_mid_round_with_min_clients_met_completes(
    cli: Cli, e2e_system: System, tmp_path: Path,
) -> None:
    system = e2e_system
    first, second = system.agents[:2]
    job_id = cli.submit(sag_job(tmp_path, "survivor", sites=[first.site, second.site],
                                min_clients=1, num_rounds=2, seconds=3.0))
    report = wait_for(lambda: second.report(job_id), timeout=60,
                      what="the second site's client job to start")
    second.kill()
    os.killpg(report["process_group"], signal.SIGKILL)
    try:
        completed(cli, system, job_id)
        reports = rounds(cli.result(job_id, tmp_path))
        assert set(reports[-1]["metrics"]["sites"]) == {first.site}
    finally:
        second.launch()
        system.wait_online(second.site)
    wait_for(lambda: system.freed(job_id), timeout=30, what="sites freed")


def test_resume_continues_after_the_last_completed_round(cli: Cli, e2e_system: System,
                                                        tmp_path: Path) -> None:
    sites = e2e_system.sites[:2]
    folder = sag_job(tmp_path, "long", sites=sites, min_clients=2, num_rounds=4, seconds=1.0)
    job_id = cli.submit(folder)
    wait_for(lambda: e2e_system.blobs.exists(e2e_system.names.job_checkpoint_key(job_id)),
             timeout=90, what="a first checkpoint")
    cli.run("abort", job_id)
    assert cli.watch(job_id)["status"] == S.FINISHED_ABORTED.value
    resumed = cli.json("resume", job_id)["id"]
    completed(cli, e2e_system, resumed)
    reports = rounds(cli.result(resumed, tmp_path))
    assert reports[0]["round"] >= 1 and reports[-1]["round"] == 3
    model = io.BytesIO(cli.result(resumed, tmp_path / "again")["model.npz"])
    assert np.load(model)["w"].tolist() == [[4.0, 4.0], [4.0, 4.0]]  # +1 per round, 4 rounds
    shutil.rmtree(tmp_path / "again", ignore_errors=True)
