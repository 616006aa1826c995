"""The job commands of `fedhive` without a gateway: settings resolution, exit codes, the JSON
schema, status parsing and admin tokens. (Against a real gateway: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fedhive.auth import AdminDirectory
from fedhive.cli.connection import GatewayTarget, load_config_file
from fedhive.cli.jobs import parse_statuses
from fedhive.cli.main import app
from fedhive.cli.render import iso, job_json
from fedhive.errors import ConfigError
from fedhive.jobs.record import JobMeta, JobRecord, StatusChange, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.jobs.tiers import hierarchy_meta

runner = CliRunner()
UNREACHABLE = "127.0.0.1:9"  # discard port: nothing listens


def _home(tmp_path: Path, config: str | None = None) -> dict[str, str]:
    if config is not None:
        (tmp_path / ".fedhive").mkdir()
        (tmp_path / ".fedhive" / "config").write_text(config)
    return {"HOME": str(tmp_path), "FEDHIVE_GATEWAY": "", "FEDHIVE_TOKEN": ""}


def test_missing_gateway_is_a_usage_error_in_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["jobs"], env=_home(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "no gateway address" in result.stderr


def test_missing_token_is_named(tmp_path: Path) -> None:
    result = runner.invoke(app, ["--gateway", UNREACHABLE, "sites"], env=_home(tmp_path))
    assert result.exit_code == 2 and "no admin token" in result.stderr


def test_unreachable_gateway_is_an_error_without_traceback(tmp_path: Path) -> None:
    env = {**_home(tmp_path), "FEDHIVE_GATEWAY": UNREACHABLE, "FEDHIVE_TOKEN": "x"}
    result = runner.invoke(app, ["job", "some-id"], env=env)
    assert result.exit_code == 5  # unreachable
    assert result.stderr.startswith(f"error: gateway {UNREACHABLE} is unavailable")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_config_file_fills_what_options_leave_unset(tmp_path: Path) -> None:
    env = _home(tmp_path, 'gateway = "from-file:1"\ntoken = "file-token"\n'
                          'ca_cert = "certs/ca.pem"\n')
    merged = GatewayTarget(token="option-token").merged(
        load_config_file(tmp_path / ".fedhive" / "config")
    )
    assert merged.gateway == "from-file:1" and merged.token == "option-token"
    assert merged.ca_cert == tmp_path / ".fedhive" / "certs" / "ca.pem"
    # Through the CLI: the CA file named by the config file does not exist -> usage error.
    result = runner.invoke(app, ["sites"], env=env)
    assert result.exit_code == 2 and "ca.pem" in result.stderr


def test_another_config_file_by_option_or_environment(tmp_path: Path) -> None:
    """`--config FILE` / FEDHIVE_CONFIG (what `fedhive poc start` tells its user to export)
    replace ~/.fedhive/config."""
    env = _home(tmp_path, 'gateway = "home:1"\ntoken = "t"\nca_cert = "home-ca.pem"\n')
    other = tmp_path / "poc" / "config"
    other.parent.mkdir()
    other.write_text('gateway = "poc:1"\ntoken = "t"\nca_cert = "poc-ca.pem"\n')
    for args, extra in ((["--config", str(other)], {}), ([], {"FEDHIVE_CONFIG": str(other)})):
        result = runner.invoke(app, [*args, "sites"], env={**env, **extra})
        assert result.exit_code == 2 and "poc-ca.pem" in result.stderr, result.stderr
    result = runner.invoke(app, ["sites"], env={**env, "FEDHIVE_CONFIG": ""})
    assert result.exit_code == 2 and "home-ca.pem" in result.stderr


@pytest.mark.parametrize(("content", "message"), [
    ("gateway = ", "invalid TOML"),
    ('gatway = "x"', "unknown key"),
    ("token = 5", "token must be a str"),
])
def test_bad_config_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config_file(path)


def test_a_missing_config_file_is_empty(tmp_path: Path) -> None:
    assert load_config_file(tmp_path / "nope") == GatewayTarget()


def test_submit_validates_locally_first(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text(json.dumps({"name": "x", "deploy_map": {"app": ["site-1"]},
                                               "min_clients": 5}))
    (job / "app" / "config" / "config_fed_client.json").write_text("{}")
    env = {**_home(tmp_path), "FEDHIVE_GATEWAY": UNREACHABLE, "FEDHIVE_TOKEN": "x"}
    result = runner.invoke(app, ["submit", str(job)], env=env)
    assert result.exit_code == 2  # a bad input file: nothing was sent
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 2  # no server app, min_clients too large: every violation, one a line
    assert any("server" in line for line in lines) and any("min_clients" in line for line in lines)


def test_statuses_parse_from_flare_strings_names_and_finished() -> None:
    assert parse_statuses(["FINISHED:ABORTED", "submitted"]) == [
        JobStatus.FINISHED_ABORTED, JobStatus.SUBMITTED,
    ]
    assert parse_statuses(["finished_cant_schedule"]) == [JobStatus.FINISHED_CANT_SCHEDULE]
    assert parse_statuses(["FINISHED"]) == [s for s in JobStatus if s.is_final]
    with pytest.raises(typer.BadParameter, match="'DONE' is not a job status"):
        parse_statuses(["DONE"])


def test_bad_status_option_is_a_usage_error(tmp_path: Path) -> None:
    env = {**_home(tmp_path), "FEDHIVE_GATEWAY": UNREACHABLE, "FEDHIVE_TOKEN": "x"}
    assert runner.invoke(app, ["jobs", "--status", "DONE"], env=env).exit_code == 2


def test_job_json_schema() -> None:
    record = JobRecord(
        job_id="j1",
        meta=JobMeta(name="n", deploy_map={"app": ["server", "s1"]}, min_clients=1,
                     extra={"cloned_from": "j0"}),
        status=JobStatus.RUNNING,
        submitter=Submitter("alice", "a", "lead"),
        submit_time_ms=1_700_000_000_000,
        start_time_ms=1_700_000_001_000,
        schedule_count=2,
        sites=["s1"],
        history=[
            StatusChange(None, JobStatus.SUBMITTED, "submitted", 1_700_000_000_000),
            StatusChange(JobStatus.SUBMITTED, JobStatus.DISPATCHED, "go", 1_700_000_000_500),
            StatusChange(JobStatus.DISPATCHED, JobStatus.RUNNING, "started", 1_700_000_001_000),
        ],
    )
    values = job_json(record, now_ms=1_700_000_011_500)
    assert list(values) == [
        "id", "name", "status", "status_reason", "submitter", "org", "role", "submit_time",
        "start_time", "end_time", "duration_s", "schedule_count", "last_schedule_time",
        "next_schedule_time", "sites", "failed_sites", "deploy_map", "resource_spec",
        "min_clients", "mandatory_clients", "cloned_from", "resumed_from", "parent",
        "pending_reason", "site_states", "history", "last_errors",
    ]
    assert values["status"] == "RUNNING" and values["status_reason"] == "started"
    assert values["submit_time"] == "2023-11-14T22:13:20.000Z"
    assert values["end_time"] is None and values["duration_s"] == 10.5
    assert values["cloned_from"] == "j0" and values["resumed_from"] is None
    assert job_json(replace(record, resumed_from="j-old"), 0)["resumed_from"] == "j-old"
    assert values["parent"] is None
    child = replace(record, meta=replace(record.meta, extra=hierarchy_meta(3, "j1", "hub-a")))
    assert job_json(child, 0)["parent"] == {"tier": 2, "job_id": "j1", "hub_site": "hub-a"}
    assert values["history"][0] == {"from": None, "to": "SUBMITTED", "reason": "submitted",
                                    "at": "2023-11-14T22:13:20.000Z"}
    json.dumps(values)  # JSON-able as is
    assert iso(None) is None and iso(0) is None


def test_admin_token_prints_a_loadable_entry(tmp_path: Path) -> None:
    result = runner.invoke(app, ["admin-token", "Carol@C.org", "--org", "c", "--role", "lead"])
    assert result.exit_code == 0
    token = result.stderr.strip().rsplit(" ", 1)[-1]
    entry = json.loads(result.stdout)
    assert "token" not in entry
    admin = AdminDirectory.parse({"admins": [entry]}).authenticate(token)
    assert (admin.name, admin.org, admin.role.value) == ("carol@c.org", "c", "lead")
    bad = runner.invoke(app, ["admin-token", "x", "--org", "c", "--role", "owner"])
    assert bad.exit_code == 2
