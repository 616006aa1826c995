"""docker-compose.yml for real: build the image, bring the stack up with a generated env file,
wait until every service is healthy and both sites are online, run examples/hello-numpy through
the `fedhive` CLI against the published gateway, then `docker compose down -v`.

Needs a Docker engine with the Compose plugin; skipped (saying which is missing) without one.
The project name, image tag and every published port are its own, so it runs beside a local
RabbitMQ/Redis and beside another compose deployment.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedhive.poc.s3server import free_ports

ROOT = Path(__file__).resolve().parents[2]
FEDHIVE = str(Path(sys.executable).parent / "fedhive")
LONG_RUNNING = {"rabbitmq", "redis", "minio", "job-store", "scheduler", "job-runner", "gateway",
                "site-1", "site-2"}
ONE_SHOTS = {"create-bucket", "broker-users", "admins"}
UP_TIMEOUT_S = 300
JOB_TIMEOUT_S = 300


def _fails(*argv: str) -> str | None:
    """Why `argv` did not succeed (None when it did)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return None if done.returncode == 0 else (said[-1] if said else f"exit code {done.returncode}")


def _why_no_docker() -> str | None:
    if shutil.which("docker") is None:
        return "no `docker` command on this machine"
    if (why := _fails("docker", "info")) is not None:
        return f"no Docker engine answers `docker info`: {why}"
    if (why := _fails("docker", "compose", "version")) is not None:
        return f"the Docker Compose plugin is missing: {why}"
    return None


NO_DOCKER = _why_no_docker()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S * 3 + JOB_TIMEOUT_S),
              pytest.mark.skipif(NO_DOCKER is not None, reason=NO_DOCKER or "")]


class Stack:
    def __init__(self, env_file: Path, token: str, gateway_port: int) -> None:
        self.project = f"fedhive-smoke-{secrets.token_hex(3)}"
        self.env_file = env_file
        self.token = token
        self.gateway = f"127.0.0.1:{gateway_port}"

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", "compose", "--project-directory", str(ROOT), "-f",
             str(ROOT / "docker-compose.yml"), "-p", self.project, "--env-file",
             str(self.env_file), *args],
            capture_output=True, text=True, timeout=timeout, check=False)

    def containers(self) -> list[dict[str, Any]]:
        """`docker compose ps -a` as dicts (a JSON array or one object per line, by version)."""
        done = self.compose("ps", "-a", "--format", "json")
        assert done.returncode == 0, done.stderr
        text = done.stdout.strip()
        if text.startswith("["):
            rows: list[dict[str, Any]] = json.loads(text)
            return rows
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def cli(self, *args: str) -> Any:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("FEDHIVE_")}
        env.update(FEDHIVE_GATEWAY=self.gateway, FEDHIVE_TOKEN=self.token,
                   FEDHIVE_CONFIG=str(self.env_file.parent / "no-config"))
        done = subprocess.run([FEDHIVE, *args, "--json"], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60").stdout[-20000:]


def _env_file(path: Path, ports: list[int], tag: str) -> str:
    token = "fh_" + secrets.token_urlsafe(32)
    names = ["FEDHIVE_GATEWAY_PORT", "RABBITMQ_PORT", "RABBITMQ_MANAGEMENT_PORT", "REDIS_PORT",
             "MINIO_PORT", "MINIO_CONSOLE_PORT"]
    values = {
        "RABBITMQ_USER": "fedhive", "RABBITMQ_PASSWORD": secrets.token_urlsafe(18),
        "RABBITMQ_SERVICES_PASSWORD": secrets.token_urlsafe(18),
        "REDIS_PASSWORD": secrets.token_urlsafe(18), "MINIO_ROOT_USER": "fedhive",
        "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(18), "FEDHIVE_S3_BUCKET": "fedhive",
        "FEDHIVE_TOKEN": token, "FEDHIVE_IMAGE_TAG": tag, **dict(zip(names, map(str, ports),
                                                                    strict=True)),
    }
    path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
    path.chmod(0o600)
    return token


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    ports = free_ports(6)
    tag = f"smoke-{secrets.token_hex(3)}"
    env_file = tmp_path / "compose.env"
    running = Stack(env_file, _env_file(env_file, ports, tag), ports[0])
    try:
        # hello-numpy needs no torch: a smaller image builds faster
        built = running.compose("build", "--build-arg", "EXAMPLE_PACKAGES=", timeout=UP_TIMEOUT_S)
        assert built.returncode == 0, built.stderr[-5000:]
        up = running.compose("up", "-d", timeout=UP_TIMEOUT_S)
        assert up.returncode == 0, up.stderr[-5000:] + running.logs()
        yield running
    finally:
        running.compose("down", "-v", "--remove-orphans", timeout=UP_TIMEOUT_S)
        subprocess.run(["docker", "image", "rm", "-f", f"fedhive:{tag}"], capture_output=True,
                       timeout=120, check=False)


def _wait_healthy(stack: Stack) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while True:
        rows = stack.containers()
        failed = [row for row in rows if row["Service"] in ONE_SHOTS and row["State"] == "exited"
                  and int(row.get("ExitCode", 0)) != 0]
        assert not failed, f"one-shot failed: {failed}\n{stack.logs()}"
        health = {}
        for row in rows:
            if row["Service"] in LONG_RUNNING:
                health.setdefault(row["Service"], []).append(row.get("Health") or row["State"])
        if set(health) == LONG_RUNNING and all(state == "healthy" for states in health.values()
                                               for state in states):
            assert len(health["scheduler"]) == 2  # both replicas
            return
        assert time.monotonic() < deadline, f"not healthy: {health}\n{stack.logs()}"
        time.sleep(2)


def test_the_compose_stack_runs_hello_numpy(stack: Stack) -> None:
    _wait_healthy(stack)
    deadline = time.monotonic() + 60
    while {site["name"] for site in stack.cli("sites") if site["online"]} != {"site-1", "site-2"}:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(1)

    job = stack.cli("submit", str(ROOT / "examples" / "hello-numpy"))["id"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (record := stack.cli("job", job))["status"].startswith("FINISHED"):
        assert time.monotonic() < deadline, f"{record['status']}\n{stack.logs()}"
        time.sleep(2)
    assert record["status"] == "FINISHED:COMPLETED", f"{record}\n{stack.logs()}"
