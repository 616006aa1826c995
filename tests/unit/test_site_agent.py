"""The site agent's logic without a broker: site.json, records, commands, reconcile, status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedhive.config import Settings, child_environment
from fedhive.errors import AlreadyExists, ConfigError, FailedPrecondition, InvalidArgument
from fedhive.jobs.archive import UnsafeArchive
from fedhive.resources import build_resources
from fedhive_services.site_agent import process
from fedhive_services.site_agent.agent import SiteAgent
from fedhive_services.site_agent.bundle import expired
from fedhive_services.site_agent.config import agent_settings, load_site
from fedhive_services.site_agent.records import JobRecord, JobState, Workspace, read_json
from fedhive_services.site_agent.status import render, site_status
from tests.fixtures.site_agent import CLIENT_APP, LIST_GPUS, app_bundle, write_site

BROKER = "amqp://site-1:secret@broker.example:5672/%2F"


def make_agent(tmp_path: Path, bundles: dict[str, bytes] | None = None) -> SiteAgent:
    site_dir = write_site(tmp_path, site="site-1", broker_url=BROKER, namespace="ns")
    config = load_site(site_dir)
    served = bundles or {}

    def download(url: str, what: str, limit: int) -> bytes:
        return served[url]

    agent = SiteAgent(config, build_resources(LIST_GPUS), Workspace(config.workspace),
                      downloader=download)
    agent.reconcile()
    return agent


def test_site_json_defaults_and_settings(tmp_path: Path) -> None:
    site_dir = tmp_path / "s"
    (site_dir / "local").mkdir(parents=True)
    (site_dir / "local" / "site.json").write_text(
        json.dumps({"site": "site-1", "broker_url": BROKER})
    )
    config = load_site(site_dir)
    assert (config.namespace, config.heartbeat_interval_s, config.abort_grace_s) == (
        "fedhive", 5.0, 10.0)
    assert config.workspace == site_dir.resolve() / "workspace"
    assert "secret" not in repr(config)
    base = Settings(aws_access_key_id="AK", aws_secret_access_key="SK", log_level="DEBUG")
    settings = agent_settings(base, config)
    assert (settings.amqp_url, settings.namespace, settings.log_level) == (BROKER, "fedhive",
                                                                          "DEBUG")
    assert settings.aws_access_key_id is None and settings.aws_secret_access_key is None


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"site": "server"}, "site", "'server' is reserved"),
        ({"namespace": "Bad NS"}, "namespace", "namespace='Bad NS' must be"),
        ({"abort_grace_s": 0}, "abort_grace_s", "must be a positive number, got 0"),
        ({"org": 3}, "org", "field 'org' must be a non-empty string, got 3"),
        ({"client_job_module": "a b"}, "client_job_module", "is not a module path"),
    ],
)
def test_site_json_errors_name_file_and_field(
    tmp_path: Path, fields: dict[str, object], field: str, message: str
) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "site.json").write_text(
        json.dumps({"site": "site-1", "broker_url": BROKER, **fields})
    )
    with pytest.raises(ConfigError) as err:
        load_site(tmp_path)
    assert err.value.field == field
    assert str(err.value).startswith(f"{tmp_path / 'local' / 'site.json'}: ")
    assert message in str(err.value)


def test_deploy_is_idempotent_and_one_app_per_job(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"u1": app_bundle(CLIENT_APP)})
    record = agent.deploy("job-1", "app", "u1", 0)
    assert (record.state, record.app_name) == (JobState.DEPLOYED, "app")
    assert agent.deploy("job-1", "app", "u-never-fetched", 0) == record
    with pytest.raises(AlreadyExists, match="job job-1 already has app 'app' on site site-1"):
        agent.deploy("job-1", "other", "u1", 0)
    with pytest.raises(InvalidArgument, match="invalid app name"):
        agent.deploy("job-2", "../app", "u1", 0)
    with pytest.raises(InvalidArgument, match="invalid job id"):
        agent.deploy(".hidden", "app", "u1", 0)


def test_unsafe_bundle_leaves_nothing(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"bad": app_bundle({"ok.txt": "x", "a/../../b": "y"})})
    with pytest.raises(UnsafeArchive) as err:
        agent.deploy("job-1", "app", "bad", 0)
    assert err.value.violations == ["the bundle of job job-1: member 'a/../../b': '..' in path"]
    workspace = agent.config.workspace
    assert sorted(p.name for p in workspace.iterdir()) == [".agent"]
    assert agent.jobs() == []


def test_allocate_free_and_start_preconditions(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"u": app_bundle(CLIENT_APP)})
    token = agent.check_resources("job-1", {"gpu": 1}).token
    allocated = agent.allocate("job-1", token)
    assert allocated.allocation == {"gpu": [0]}
    assert agent.allocate("job-1", token) == allocated  # redelivered
    other = agent.check_resources("job-1", {"gpu": 1}).token
    with pytest.raises(AlreadyExists, match="job-1 already holds resources"):
        agent.allocate("job-1", other)
    with pytest.raises(FailedPrecondition, match="never deployed"):
        agent.start("job-1", "q")
    agent.deploy("job-1", "app", "u", 0)
    freed = agent.free("job-1")
    assert freed is not None and freed.allocation is None and freed.state is JobState.DEPLOYED
    assert agent.free("job-1") == freed  # free twice is fine
    assert agent.free("never-heard-of") is None
    with pytest.raises(FailedPrecondition, match="holds no resources"):
        agent.start("job-1", "q")
    aborted = agent.abort("job-1", "")
    assert (aborted.state, aborted.reason) == (JobState.ABORTED, "aborted")
    assert agent.abort("job-1", "again").reason == "aborted"
    assert agent.start("job-1", "q").state is JobState.ABORTED  # never started afterwards
    assert agent.report_resources()["free"] == {"gpu": 1}  # `other` is still reserved


def test_reconcile_marks_vanished_jobs_lost_and_holds_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone_pid = int(done.stdout)
    ws = Workspace(tmp_path / "workspace")
    ws.save_job(JobRecord("job-run", JobState.RUNNING, app_name="app", token="t1",
                          allocation={"gpu": [0]}, pid=gone_pid, pid_started=1))
    ws.save_job(JobRecord("job-dep", JobState.DEPLOYED, app_name="app", token="t2",
                          allocation={"gpu": [1]}))
    ws.save_job(JobRecord("job-old", JobState.FINISHED, app_name="app", exit_code=0))
    agent = make_agent(tmp_path)
    states = {r.job_id: (r.state, r.allocation) for r in agent.jobs()}
    assert states == {"job-run": (JobState.LOST, None), "job-dep": (JobState.DEPLOYED, None),
                      "job-old": (JobState.FINISHED, None)}
    assert agent.running_job_ids() == []
    assert read_json(ws.job_file("job-run"))["state"] == "LOST"
    assert agent.report_resources()["free"] == {"gpu": 2}


def test_status_reads_only_the_site_files(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"u": app_bundle(CLIENT_APP)})
    agent.allocate("job-1", agent.check_resources("job-1", {"gpu": 2}).token)
    agent.deploy("job-1", "app", "u", 0)
    status = site_status(tmp_path)
    assert status.to_json()["jobs"][0]["allocation"] == {"gpu": [0, 1]}
    text = render(status)
    assert "site site-1" in text and "agent: not running" in text
    assert any(line.split()[:4] == ["job-1", "DEPLOYED", "app", '{"gpu":'] for line in
               text.splitlines())


def test_process_identity() -> None:
    me = process.start_time(os.getpid())
    assert me is not None
    assert process.alive(os.getpid(), me)
    assert not process.alive(os.getpid(), me + 1)  # a reused pid is not our process
    assert not process.alive(0, None)
    assert child_environment({"CUDA_VISIBLE_DEVICES": "3"})["CUDA_VISIBLE_DEVICES"] == "3"


def test_expiry() -> None:
    assert not expired(0, 10)  # unknown expiry: let S3 decide
    assert expired(10, 10) and not expired(11, 10)
