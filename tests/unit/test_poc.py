"""The POC's pieces that need no infrastructure: state file, files it writes, command lines and
environments, process handling, checks (tests/e2e/test_poc.py runs the whole thing)."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from fedhive.auth import hash_token
from fedhive.config import Settings
from fedhive.errors import InvalidArgument, PocFailed
from fedhive.poc import checks, procs
from fedhive.poc.demo import find_examples
from fedhive.poc.layout import MARKER, PocLayout
from fedhive.poc.services import admin_token, commands, environment
from fedhive.poc.start import PocOptions
from fedhive.poc.state import PocState, ProcessEntry, load_state
from fedhive.poc.stop import _tiers

SETTINGS = Settings(amqp_url="amqp://u:secret@127.0.0.1:5672/%2F",
                    s3_endpoint_url="http://127.0.0.1:9000", aws_access_key_id="k",
                    aws_secret_access_key="s", namespace="poc")


def entry(name: str, pid: int = 1, create_time: float = 1.0) -> ProcessEntry:
    return ProcessEntry(name, pid, create_time, f"/x/{name}.log", ["x"])


def test_the_state_file_round_trips_and_a_missing_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert load_state(path) is None
    state = PocState(str(tmp_path), "poc", ["site-1"], "127.0.0.1:50051", "http://s3", True,
                     "2026-01-01T00:00:00+00:00", [entry("gateway")], ["site-1"], ["redis"])
    state.save(path)
    assert load_state(path) == state
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_text("{not json")
    with pytest.raises(PocFailed, match="cannot read"):
        load_state(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(PocFailed, match="not a state file"):
        load_state(path)


def test_the_admin_token_survives_a_restart(tmp_path: Path) -> None:
    layout = PocLayout(tmp_path)
    token = admin_token(layout, "127.0.0.1:50051")
    assert admin_token(layout, "127.0.0.1:50052") == token
    assert 'gateway = "127.0.0.1:50052"' in layout.cli_config.read_text()
    admins = json.loads(layout.admins.read_text())["admins"]
    assert [a["token_sha256"] for a in admins] == [hash_token(token)]
    assert layout.cli_config.stat().st_mode & 0o777 == 0o600
    layout.admins.write_text(json.dumps({"admins": []}))  # the token no longer matches: new one
    assert admin_token(layout, "127.0.0.1:50051") != token


def test_site_names_come_from_the_prefix() -> None:
    assert PocOptions(sites=3, site_prefix="h-").site_names() == ["h-1", "h-2", "h-3"]
    with pytest.raises(InvalidArgument):
        PocOptions(site_prefix="bad.").site_names()
    with pytest.raises(InvalidArgument):
        PocOptions(sites=0).site_names()


def test_commands_and_stop_order(tmp_path: Path) -> None:
    layout = PocLayout(tmp_path)
    found = commands(layout, ["a-1", "a-2"], "127.0.0.1:1")
    assert [c.name for c in found] == ["job-store", "scheduler", "job-runner", "gateway",
                                       "site-a-1", "site-a-2"]
    assert found[4].argv[-2:] == ["--site-dir", str(layout.site_dir("a-1"))]
    entries = [entry("seaweedfs"), *(entry(c.name) for c in found)]
    assert [[e.name for e in tier] for tier in _tiers(entries)] == [
        ["scheduler", "job-runner"], ["job-store", "gateway", "site-a-1", "site-a-2"],
        ["seaweedfs"]]


def test_sites_get_no_service_credentials(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-user")
    layout = PocLayout(tmp_path)
    services = environment(SETTINGS, layout)
    assert services["FEDHIVE_AMQP_URL"] == SETTINGS.amqp_url
    assert services["AWS_SECRET_ACCESS_KEY"] == "s" and services[MARKER] == str(tmp_path)
    site = environment(SETTINGS, layout, site=True)
    assert site[MARKER] == str(tmp_path)
    assert not [k for k in site if k.startswith("AWS_") or k in (
        "FEDHIVE_AMQP_URL", "FEDHIVE_REDIS_URL", "FEDHIVE_S3_ENDPOINT_URL")]


def test_processes_by_pid_and_create_time(tmp_path: Path) -> None:
    sleeper = procs.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                          env={MARKER: str(tmp_path)}, log=tmp_path / "s.log", cwd=tmp_path)
    try:
        assert procs.alive(sleeper)
        assert not procs.alive(ProcessEntry("other", sleeper.pid, sleeper.create_time - 5,
                                            "", []))  # same pid, another process
        deadline = time.monotonic() + 10
        while sleeper.pid not in [p.pid for p in procs.marked(tmp_path)]:
            assert time.monotonic() < deadline, "the marked process is not found"
            time.sleep(0.05)
    finally:
        assert procs.stop_groups([sleeper], grace=5) == []
    assert not procs.alive(sleeper)
    assert procs.exit_code(sleeper) == -15  # SIGTERM
    assert procs.marked(tmp_path) == []


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PocFailed) as err:
            checks.port_free("127.0.0.1", port, "gateway", "--port")
    assert str(err.value) == (f"port {port} (gateway) is already in use: stop the program "
                              "listening there, or pass --port with a free port")


def test_examples_are_found_or_named(tmp_path: Path) -> None:
    repo_examples = Path(__file__).resolve().parents[2] / "examples"
    assert find_examples(repo_examples) == repo_examples
    with pytest.raises(PocFailed, match="hello-numpy and hello-pt are not in"):
        find_examples(tmp_path)
