"""docker-compose.yml for real: build the image, bring the stack up with a generated env file,
wait until every service is healthy and both sites are online, run examples/hello-numpy through
the `fedhive` CLI against the published gateway, then `docker compose down -v`; and
`fedhive demo --compose` (what `make demo` runs where a Docker engine answers) end to end.

Needs a Docker engine with the Compose plugin; skipped (saying which is missing) without one.
The project names, image tags and every published port are the tests' own, so they run beside a
local RabbitMQ/Redis and beside another compose deployment. Both drive the stack through
fedhive.poc.compose, as the demo does.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedhive.poc import compose
from fedhive.poc.compose import ComposeStack
from fedhive.poc.s3server import free_ports

ROOT = Path(__file__).resolve().parents[2]
FEDHIVE = str(Path(sys.executable).parent / "fedhive")
UP_TIMEOUT_S = 900
JOB_TIMEOUT_S = 300

NO_DOCKER = compose.why_no_engine()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(UP_TIMEOUT_S * 2 + JOB_TIMEOUT_S),
              pytest.mark.skipif(NO_DOCKER is not None, reason=NO_DOCKER or "")]


def cli(stack: ComposeStack, *args: str) -> Any:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FEDHIVE_")}
    env.update(FEDHIVE_GATEWAY=stack.gateway, FEDHIVE_TOKEN=stack.settings()["FEDHIVE_TOKEN"],
               FEDHIVE_CONFIG=str(stack.env_file.parent / "no-config"))
    done = subprocess.run([FEDHIVE, *args, "--json"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def logs(stack: ComposeStack) -> str:
    return stack.run("logs", "--no-color", "--tail", "60").stdout[-20000:]


def remove_image(tag: str) -> None:
    subprocess.run(["docker", "image", "rm", "-f", f"fedhive:{tag}"], capture_output=True,
                   timeout=120, check=False)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ComposeStack]:
    running = ComposeStack(ROOT, tmp_path / "compose.env", f"fedhive-smoke-{secrets.token_hex(3)}")
    tag = running.project
    compose.write_env_file(running.env_file, compose.env_values(free_ports(1)[0], tag))
    try:
        # hello-numpy needs no torch: a smaller image builds faster
        running.up("EXTRAS=", timeout=UP_TIMEOUT_S)
        yield running
    finally:
        running.down()
        remove_image(tag)


def test_the_compose_stack_runs_hello_numpy(stack: ComposeStack) -> None:
    stack.wait_healthy(UP_TIMEOUT_S)
    replicas = [row for row in stack.containers() if row["Service"] == "scheduler"]
    assert len(replicas) == 2
    deadline = time.monotonic() + 60
    while {site["name"] for site in cli(stack, "sites") if site["online"]} != set(compose.SITES):
        assert time.monotonic() < deadline, logs(stack)
        time.sleep(1)

    job = cli(stack, "submit", str(ROOT / "examples" / "hello-numpy"))["id"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (record := cli(stack, "job", job))["status"].startswith("FINISHED"):
        assert time.monotonic() < deadline, f"{record['status']}\n{logs(stack)}"
        time.sleep(2)
    assert record["status"] == "FINISHED:COMPLETED", f"{record}\n{logs(stack)}"


def test_the_demo_runs_both_examples_through_compose_and_takes_it_down(tmp_path: Path) -> None:
    namespace = f"smoke{secrets.token_hex(3)}"
    record = tmp_path / "demo.json"
    done = subprocess.run(
        [FEDHIVE, "demo", "--compose", "--dir", str(tmp_path / "demo"), "--namespace", namespace,
         "--port", str(free_ports(1)[0]), "--record", str(record)],
        cwd=ROOT, capture_output=True, text=True, timeout=UP_TIMEOUT_S * 2, check=False)
    assert done.returncode == 0, done.stderr + done.stdout[-5000:]
    assert "compose: building the image and starting compose project" in done.stdout
    measured = json.loads(record.read_text())
    assert measured["jobs"]["hello-pt"]["final_metrics"]["accuracy"] >= 0.9
    left = subprocess.run(["docker", "ps", "-a", "-q", "--filter",
                           f"label=com.docker.compose.project=fedhive-{namespace}"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert left.stdout.strip() == ""  # the image fedhive:demo stays, as after `make demo`
    assert not (tmp_path / "demo" / "compose.env").exists()
