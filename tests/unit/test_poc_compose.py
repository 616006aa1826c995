"""fedhive.poc.compose without a Docker engine: the env file the demo generates, reading
`docker compose ps`, deciding when the stack is ready or broken, the commands it runs and shows,
and the reasons it gives for not using docker compose (the docker client of this machine, when
it has one but no engine). tests/unit/test_compose.py checks the generated env against
docker-compose.yml; tests/e2e/test_compose_smoke.py runs it all where an engine answers."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import quote

import pytest

from fedhive.errors import PocFailed
from fedhive.poc import compose
from fedhive.poc.compose import ComposeStack

ROOT = Path(__file__).resolve().parents[2]


def test_the_env_file_has_fresh_secrets_free_ports_and_is_private(tmp_path: Path) -> None:
    first, second = compose.env_values(50123, tag="demo"), compose.env_values(50123, tag="demo")
    secrets = [name for name in first if name.endswith(("PASSWORD", "TOKEN"))]
    assert len(secrets) == 5
    assert all(first[name] != second[name] for name in secrets)  # new ones each time
    assert all(first[name] == quote(first[name], safe="-_.~") for name in secrets)  # URL-safe
    assert re.fullmatch(r"fh_[A-Za-z0-9_-]{43}", first["FEDHIVE_TOKEN"])
    ports = [int(first[name]) for name in compose.PORT_SETTINGS]
    assert ports[0] == 50123 and len(set(ports)) == len(ports)
    assert first["FEDHIVE_IMAGE_TAG"] == "demo"

    path = tmp_path / "demo" / "compose.env"
    compose.write_env_file(path, first)
    assert path.stat().st_mode & 0o777 == 0o600
    assert compose.read_env_file(path) == first
    stack = ComposeStack(ROOT, path, "fedhive-demo")
    assert stack.gateway == "127.0.0.1:50123"


PS_ROWS = [
    {"Service": "rabbitmq", "State": "running", "Health": "healthy"},
    {"Service": "create-bucket", "State": "exited", "Health": "", "ExitCode": 0},
    {"Service": "scheduler", "State": "running", "Health": "healthy"},
]


def test_ps_output_is_read_as_an_array_or_one_object_per_line() -> None:
    assert compose.parse_ps(json.dumps(PS_ROWS)) == PS_ROWS
    assert compose.parse_ps("\n".join(json.dumps(row) for row in PS_ROWS) + "\n") == PS_ROWS
    assert compose.parse_ps("") == []


def _healthy() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [
        {"Service": name, "State": "running", "Health": "healthy"}
        for name in sorted(compose.LONG_RUNNING)]
    rows.append({"Service": "scheduler", "State": "running", "Health": "healthy"})  # 2 replicas
    return rows + [{"Service": name, "State": "exited", "Health": "", "ExitCode": 0}
                   for name in compose.ONE_SHOTS]


def test_ready_when_every_long_running_container_is_healthy() -> None:
    assert compose.readiness(_healthy()) == (True, "")
    rows = _healthy()
    second = len(compose.LONG_RUNNING)  # the second scheduler replica
    assert rows[second]["Service"] == "scheduler"
    rows[second] = {"Service": "scheduler", "State": "running", "Health": "starting"}
    assert compose.readiness(rows) == (False, "scheduler (starting)")
    missing = [row for row in _healthy() if row["Service"] not in ("gateway", "site-2")]
    assert compose.readiness(missing) == (False, "gateway, site-2")


def test_a_failed_one_shot_or_an_exited_service_is_an_error_naming_it() -> None:
    rows = _healthy()
    rows[-1] = {**rows[-1], "ExitCode": 1}
    with pytest.raises(PocFailed, match=f"^compose service {rows[-1]['Service']} exited$"):
        compose.readiness(rows)
    rows = [*_healthy(), {"Service": "job-runner", "State": "exited", "ExitCode": 0}]
    with pytest.raises(PocFailed, match=r"^compose service job-runner exited$"):
        compose.readiness(rows)


def test_commands_name_the_project_the_file_and_the_env_file(tmp_path: Path) -> None:
    stack = ComposeStack(ROOT, tmp_path / "compose.env", "fedhive-demo")
    assert stack.argv("down", "-v") == [
        "docker", "compose", "--project-directory", str(ROOT), "-f",
        str(ROOT / "docker-compose.yml"), "-p", "fedhive-demo", "--env-file",
        str(tmp_path / "compose.env"), "down", "-v"]
    assert stack.hint("logs", "site-1").startswith("docker compose --project-directory ")
    assert stack.hint("logs", "site-1").endswith(" -p fedhive-demo --env-file "
                                                 f"{tmp_path / 'compose.env'} logs site-1")


def test_the_compose_file_is_found_in_the_repository(tmp_path: Path) -> None:
    assert compose.find_compose_dir() == ROOT
    with pytest.raises(PocFailed, match=f"^docker-compose.yml is not in {tmp_path}: run from"):
        compose.find_compose_dir([tmp_path])


def test_no_docker_command_is_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert compose.why_no_engine() == "no `docker` command on this machine"


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client here")
def test_a_docker_client_without_an_engine_is_a_reason_naming_what_it_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    why = compose.why_no_engine()
    assert why is not None and why.startswith("no Docker engine answers `docker info` (")
    assert "\n" not in why


def test_a_taken_gateway_port_stops_the_start_before_anything(tmp_path: Path) -> None:
    stack = ComposeStack(ROOT, tmp_path / "compose.env", "fedhive-demo")
    said: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PocFailed, match=f"^port {port} \\(gateway\\) is already in use"):
            compose.start_stack(stack, port, said.append)
    assert said == [] and not stack.env_file.exists()



@pytest.mark.skipif(shutil.which("docker") is None or compose.why_no_engine() is None,
                    reason="needs a docker client without a working engine or Compose plugin")
def test_a_failing_build_is_one_line_and_takes_down_what_it_began(tmp_path: Path) -> None:
    """The build step runs for real with this machine's docker client, which cannot build."""
    stack = ComposeStack(ROOT, tmp_path / "compose.env", "fedhive-unit")
    said: list[str] = []
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PocFailed, match=r"^`docker compose build` failed: \S") as failed:
        compose.start_stack(stack, port, said.append, timeout=5)
    assert "\n" not in str(failed.value)
    assert said[0].startswith("building the image and starting compose project fedhive-unit")
    assert said[-1] == "stopping what was started"
    assert not stack.env_file.exists()
