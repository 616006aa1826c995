"""The docker-compose deployment (docker-compose.yml) as `fedhive demo` and the compose smoke
test drive it: is there an engine, an env file with fresh secrets and free ports, `up` (the
image built first), wait until every service is healthy, `down -v`.

Each stack is a compose project of its own (`-p`), so a demo runs beside an operator's own
deployment of the same file and beside a local RabbitMQ and Redis: every published port but
the gateway's is a free one picked at start.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhive.errors import PocFailed
from fedhive.poc import checks, probes
from fedhive.poc.layout import write_private
from fedhive.poc.s3server import free_ports
from fedhive.poc.stop import shielded

COMPOSE_FILE = "docker-compose.yml"
LONG_RUNNING = frozenset({"rabbitmq", "redis", "minio", "job-store", "scheduler", "job-runner",
                          "gateway", "site-1", "site-2"})
ONE_SHOTS = frozenset({"create-bucket", "broker-users", "admins"})
SITES = ("site-1", "site-2")
# The ports docker-compose.yml publishes on 127.0.0.1, the gateway's first.
PORT_SETTINGS = ("FEDHIVE_GATEWAY_PORT", "RABBITMQ_PORT", "RABBITMQ_MANAGEMENT_PORT",
                 "REDIS_PORT", "MINIO_PORT", "MINIO_CONSOLE_PORT")
UP_TIMEOUT_S = 1800.0  # the first build installs torch
HEALTHY_TIMEOUT_S = 300.0


def why_no_engine() -> str | None:
    """Why docker compose cannot run here (None when a Docker engine and the Compose plugin
    answer)."""
    if shutil.which("docker") is None:
        return "no `docker` command on this machine"
    if (why := _fails("docker", "info")) is not None:
        return f"no Docker engine answers `docker info` ({why})"
    if (why := _fails("docker", "compose", "version")) is not None:
        return f"the Docker Compose plugin is missing ({why})"
    return None


def _fails(*argv: str) -> str | None:
    """The last line `argv` said when it failed (None when it succeeded)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(argv)}` did not answer within 30 s"
    except OSError as err:
        return err.strerror or str(err)
    return None if done.returncode == 0 else _last_line(done)


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return said[-1].strip() if said else f"exit code {done.returncode}"


def find_compose_dir(candidates: Sequence[Path] = ()) -> Path:
    """The first of `candidates` (by default ./ and the fedhive checkout this package runs
    from, an editable install) holding docker-compose.yml and deploy/Dockerfile."""
    candidates = candidates or (Path.cwd(), Path(__file__).resolve().parents[3])
    for folder in candidates:
        if (folder / COMPOSE_FILE).is_file() and (folder / "deploy" / "Dockerfile").is_file():
            return folder.resolve()
    raise PocFailed(f"{COMPOSE_FILE} is not in {' or '.join(str(c) for c in candidates)}: run "
                    "from the fedhive repository")


def env_values(gateway_port: int, tag: str) -> dict[str, str]:
    """The settings docker-compose.yml reads: fresh passwords and admin token, the gateway on
    `gateway_port` and free ports for the rest, the image tag `tag`."""
    ports = [gateway_port, *free_ports(len(PORT_SETTINGS) - 1)]
    return {
        "RABBITMQ_USER": "fedhive", "RABBITMQ_PASSWORD": _password(),
        "RABBITMQ_SERVICES_PASSWORD": _password(), "REDIS_PASSWORD": _password(),
        "MINIO_ROOT_USER": "fedhive", "MINIO_ROOT_PASSWORD": _password(),
        "FEDHIVE_S3_BUCKET": "fedhive", "FEDHIVE_TOKEN": "fh_" + secrets.token_urlsafe(32),
        "FEDHIVE_IMAGE_TAG": tag,
        **{name: str(port) for name, port in zip(PORT_SETTINGS, ports, strict=True)},
    }


def _password() -> str:
    # URL-safe: the compose file puts passwords into amqp:// and redis:// URLs as they are
    return secrets.token_urlsafe(18)


def write_env_file(path: Path, values: dict[str, str]) -> None:
    write_private(path, "".join(f"{name}={value}\n" for name, value in values.items()))


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not name.lstrip().startswith("#"):
            values[name.strip()] = value.strip()
    return values


def parse_ps(text: str) -> list[dict[str, Any]]:
    """`docker compose ps --format json`: one JSON array (Compose < 2.21) or one object per
    line (later versions)."""
    text = text.strip()
    if text.startswith("["):
        rows: list[dict[str, Any]] = json.loads(text)
        return rows
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def readiness(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    """(every long-running service has all its containers healthy, what is not yet). Raises
    PocFailed when a one-shot set-up service failed or a service's container exited."""
    failed = [row["Service"] for row in rows if row.get("State") == "exited"
              and (row["Service"] not in ONE_SHOTS or int(row.get("ExitCode") or 0) != 0)]
    if failed:
        raise PocFailed(f"compose service {', '.join(sorted(set(failed)))} exited")
    states: dict[str, list[str]] = {}
    for row in rows:
        if row["Service"] in LONG_RUNNING:
            states.setdefault(row["Service"], []).append(row.get("Health") or row["State"])
    waiting = sorted(LONG_RUNNING - set(states)) + sorted(
        f"{service} ({', '.join(sorted(set(found) - {'healthy'}))})"
        for service, found in states.items() if any(state != "healthy" for state in found))
    return not waiting, ", ".join(waiting)


@dataclass(frozen=True)
class ComposeStack:
    """One compose project of docker-compose.yml in `directory`, configured by `env_file`."""

    directory: Path
    env_file: Path
    project: str

    def argv(self, *args: str) -> list[str]:
        return ["docker", "compose", "--project-directory", str(self.directory), "-f",
                str(self.directory / COMPOSE_FILE), "-p", self.project, "--env-file",
                str(self.env_file), *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`docker compose ARGS`; PocFailed when it does not finish within `timeout`."""
        try:
            return subprocess.run(self.argv(*args), capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise PocFailed(f"`docker compose {args[0]}` did not finish within {timeout:.0f} s: "
                            f"see `{self.hint('logs')}`") from None

    def settings(self) -> dict[str, str]:
        return read_env_file(self.env_file)

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.settings()['FEDHIVE_GATEWAY_PORT']}"

    def containers(self) -> list[dict[str, Any]]:
        done = self.run("ps", "-a", "--format", "json")
        if done.returncode != 0:
            raise PocFailed(f"`docker compose ps` failed: {_last_line(done)}")
        return parse_ps(done.stdout)

    def running(self) -> bool:
        """Every long-running service of the project has a running container."""
        return {row["Service"] for row in self.containers()
                if row.get("State") == "running"} >= LONG_RUNNING

    def up(self, *build_args: str, timeout: float = UP_TIMEOUT_S) -> None:
        """Build the image (`--build-arg` each of `build_args`) and start every service."""
        for args in (("build", *(f"--build-arg={arg}" for arg in build_args)), ("up", "-d")):
            done = self.run(*args, timeout=timeout)
            if done.returncode != 0:
                raise PocFailed(f"`docker compose {args[0]}` failed: {_last_line(done)}")

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S,
                     on_wait: Callable[[str], None] = lambda waiting: None) -> None:
        """Until every long-running service is healthy (`on_wait` sees what it waits for,
        when that changes)."""
        deadline = time.monotonic() + timeout
        shown = ""
        while True:
            ready, waiting = readiness(self.containers())
            if ready:
                return
            if waiting != shown:
                on_wait(waiting)
                shown = waiting
            if time.monotonic() > deadline:
                raise PocFailed(f"compose services not healthy after {timeout:.0f} s: {waiting}: "
                                f"see `{self.hint('logs')}`")
            time.sleep(2)

    def down(self, timeout: float = 300) -> str | None:
        """Stop and remove the containers, network and volumes; what went wrong, if anything."""
        try:
            done = self.run("down", "-v", "--remove-orphans", timeout=timeout)
        except PocFailed as err:
            return str(err)
        return None if done.returncode == 0 else _last_line(done)

    def hint(self, *args: str) -> str:
        """The command line a user types for `docker compose ARGS` on this stack."""
        return shlex.join(self.argv(*args))


Say = Callable[[str], None]


def start_stack(stack: ComposeStack, gateway_port: int, say: Say,
                timeout: float = HEALTHY_TIMEOUT_S) -> str:
    """A new env file for `stack`, the image built, every service healthy and both sites
    online; the admin token. Whatever fails (Ctrl-C too), the stack is taken down again."""
    checks.port_free("127.0.0.1", gateway_port, "gateway", "--port")
    if stack.env_file.is_file():  # an earlier run's, killed: its volumes hold other secrets
        stack.down()
    values = env_values(gateway_port, tag="demo")
    write_env_file(stack.env_file, values)
    try:
        say(f"building the image and starting compose project {stack.project} (the first build "
            "installs torch: minutes)")
        stack.up()
        stack.wait_healthy(timeout, on_wait=lambda waiting: say(f"waiting for {waiting}"))
        say(f"waiting for {', '.join(SITES)} to come online")
        deadline = time.monotonic() + timeout
        gateway = f"127.0.0.1:{gateway_port}"
        while not set(SITES) <= probes.online_sites(gateway, values["FEDHIVE_TOKEN"]):
            if time.monotonic() > deadline:
                raise PocFailed(f"sites {', '.join(SITES)} not online after {timeout:.0f} s: "
                                f"see `{stack.hint('logs', *SITES)}`")
            time.sleep(1)
    except BaseException:
        say("stopping what was started")
        with shielded():
            stack.down()
            stack.env_file.unlink(missing_ok=True)
        raise
    return values["FEDHIVE_TOKEN"]
