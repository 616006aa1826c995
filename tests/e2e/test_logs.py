"""`fedhive logs` end to end: the real CLI, gateway, job-store, scheduler, job-runner (server
jobs) and two site agents on their own broker users, over real RabbitMQ, Redis and S3. One
system for the module (tests/fixtures/e2e.py); the second site's config says
`share_logs: false`.

A job whose trainer prints a line and raises: `fedhive logs` shows the server
job's lines and the sharing site's lines, its trainer's traceback included, while the job runs
(`--follow` ends when the job has ended and every site's last line is in) and after it ends;
`--site` filters; `fedhive job` shows the site's last error; the other site shares nothing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedhive.jobs.status import JobStatus
from tests.fixtures.cli import FEDHIVE, cli_for
from tests.fixtures.cli import Cli as BaseCli
from tests.fixtures.e2e import System, running_system
from tests.fixtures.infra import RUN_ID, S3Server, free_ports, settings_for

# The private site's trainer takes its time: the sharing site's error ends the job first.
TRAINER = '''
import os
import time

site = os.environ["FEDHIVE_SITE"]
print(f"trainer starting at {site}", flush=True)
if site.endswith("-private"):
    time.sleep(120)
raise RuntimeError(f"trainer boom at {site}")
'''


@pytest.fixture(scope="module")
def system(amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    settings = settings_for(amqp_url, redis_url, s3_server, test_bucket, f"t{RUN_ID}-logs")
    sites = [f"l{RUN_ID}-shares", f"l{RUN_ID}-private"]
    with running_system(settings, tmp_path_factory.mktemp("logs"), sites, launched=1,
                        schedulers=1) as system:
        private = system.agents[1]
        config = private.site_dir / "local" / "site.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "share_logs": False}))
        private.launch()
        system.wait_online(*sites)
        yield system


class Cli(BaseCli):
    def lines(self, *args: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.run(*args, "--json").stdout.splitlines()]


@pytest.fixture(scope="module")
def cli(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    with cli_for(system.settings, tmp_path_factory.mktemp("logs-cli"), Cli) as cli:
        yield cli


def crashing_job(root: Path, sites: list[str]) -> Path:
    """ScatterAndGather over a numpy model whose trainer (client API) prints and raises."""
    folder = root / "crash"
    config = folder / "app" / "config"
    config.mkdir(parents=True)
    (folder / "app" / "custom").mkdir()
    (folder / "app" / "custom" / "train.py").write_text(TRAINER)
    (folder / "meta.json").write_text(json.dumps({
        "name": "crash", "deploy_map": {"app": ["server", *sites]}, "min_clients": len(sites)}))
    (config / "config_fed_server.json").write_text(json.dumps({
        "components": [
            {"id": "persistor", "path": "fedhive.fl.persistors.NumpyModelPersistor",
             "args": {"initial": {"w": [[0.0, 0.0]]}}},
            {"id": "aggregator",
             "path": "fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator"},
            {"id": "shareable_generator",
             "path": "fedhive.fl.shareables.FullModelShareableGenerator"},
        ],
        "workflows": [{"id": "sag", "path": "fedhive.fl.workflows.ScatterAndGather", "args": {
            "min_clients": len(sites), "num_rounds": 1, "wait_time_after_min_received": 0,
            "persistor_id": "persistor", "ignore_result_error": False}}],
    }))
    (config / "config_fed_client.json").write_text(json.dumps({
        "executors": [{"tasks": ["train"], "executor": {
            "path": "fedhive.fl.client_api_executor.ClientAPIExecutor",
            "args": {"command": "python custom/train.py", "launch_timeout": 60}}}]}))
    return folder


def test_a_failing_trainers_lines_and_traceback_are_shown(cli: Cli, system: System,
                                                         tmp_path: Path) -> None:
    shares, private = system.sites
    job_id = cli.json("submit", str(crashing_job(tmp_path, system.sites)))["id"]
    follower = subprocess.Popen([FEDHIVE, "logs", job_id, "--follow", "--json"],
                                env=cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        out, err = follower.communicate(timeout=180)  # it ends by itself once the job ended
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    job = cli.json("job", job_id)
    assert job["status"] == JobStatus.FINISHED_EXECUTION_EXCEPTION.value, job["status_reason"]

    followed = [json.loads(line) for line in out.splitlines()]
    assert followed == cli.lines("logs", job_id)  # the same lines after the job ended
    ids = [entry["id"] for entry in followed]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-")))) and len(set(ids)) \
        == len(ids)
    assert {(e["site"], e["source"]) for e in followed} == {("server", "server"),
                                                           (shares, "client_job")}
    site_lines = [e["line"] for e in followed if e["site"] == shares]
    assert f"trainer starting at {shares}" in site_lines
    start = site_lines.index("Traceback (most recent call last):")
    assert f"RuntimeError: trainer boom at {shares}" in site_lines[start:]
    assert not [e for e in followed if f"at {private}" in e["line"]]  # nothing of its trainer
    assert f"note: site {private} does not share its logs" in err

    plain = cli.run("logs", job_id).stdout.splitlines()
    assert f"{shares} client_job | RuntimeError: trainer boom at {shares}" in plain
    assert any(line.startswith("server server | ") for line in plain)
    assert {e["site"] for e in cli.lines("logs", job_id, "--site", "server")} == {"server"}
    assert {e["site"] for e in cli.lines("logs", job_id[:8], "--site", shares)} == {shares}
    nothing = cli.run("logs", job_id, "--site", private)
    assert nothing.stdout == "" and f"site {private} does not share its logs" in nothing.stderr

    errors = job["last_errors"]
    assert set(errors) - {"server"} == {shares} and errors[shares], errors
    assert "last errors" in cli.run("job", job_id).stdout


def test_exit_codes(cli: Cli) -> None:
    unknown = cli.run("logs", "00000000-0000-4000-8000-000000000000", check=False)
    assert unknown.returncode == 3 and "not found" in unknown.stderr
    denied = cli.run("logs", "whatever", check=False, FEDHIVE_TOKEN="fh_wrong")
    assert denied.returncode == 4 and unknown.stderr.count("\n") == 1
    away = cli.run("logs", "whatever", check=False,
                   FEDHIVE_GATEWAY=f"127.0.0.1:{free_ports(1)[0]}")
    assert away.returncode == 5, away.stderr
