"""`fedhive poc start|status|stop` and `fedhive demo` as a user runs them: the real command
in a subprocess, on the local RabbitMQ and Redis, with an embedded SeaweedFS.

Each test has its own POC folder (tmp), namespace (and so broker users, `<namespace>.<site>`)
and site names. Teardown stops whatever is left and deletes the namespace's queues and Redis
keys and the broker users.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedhive.brokerusers import delete_users
from fedhive.names import Names
from fedhive.poc import compose
from fedhive.poc.layout import MARKER
from fedhive.poc.procs import stop_marked
from fedhive.poc.s3server import weed_binary
from tests.fixtures.bus import Broker
from tests.fixtures.infra import RUN_ID, S3Server, delete_redis_namespace, free_ports, wait_for
from tests.fixtures.sites import CTL

FEDHIVE = str(Path(sys.executable).parent / "fedhive")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_numbers = itertools.count()


@dataclass
class Poc:
    root: Path
    namespace: str
    sites: list[str]
    port: int
    env: dict[str, str]

    @property
    def options(self) -> list[str]:
        return ["--dir", str(self.root), "--port", str(self.port), "--namespace",
                self.namespace, "--site-prefix", self.sites[0][:-1]]

    @property
    def users(self) -> list[str]:
        """The sites' broker users."""
        return [Names(self.namespace).site_user(site) for site in self.sites]

    def run(self, *args: str, timeout: float = 150,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([FEDHIVE, *args], env=self.env if env is None else env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def cli(self, *args: str) -> Any:
        """A job/site command as the POC admin (through the CLI config the POC wrote)."""
        done = self.run("--config", str(self.root / "config"), *args, "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.root / "state.json").read_text())
        return state


def _env(amqp_url: str, redis_url: str, s3: S3Server | None, bucket: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEDHIVE_", "AWS_"))}
    env.update(FEDHIVE_AMQP_URL=amqp_url, FEDHIVE_REDIS_URL=redis_url, COLUMNS="160")
    if s3 is not None:  # no SeaweedFS here: the tests' S3 stands in for the embedded one
        env.update(FEDHIVE_S3_ENDPOINT_URL=s3.endpoint_url, AWS_ACCESS_KEY_ID=s3.access_key,
                   AWS_SECRET_ACCESS_KEY=s3.secret_key, FEDHIVE_S3_BUCKET=bucket)
    return env


@pytest.fixture
def poc(tmp_path: Path, amqp_url: str, redis_url: str,
        request: pytest.FixtureRequest) -> Iterator[Poc]:
    n = next(_numbers)
    s3 = request.getfixturevalue("s3_server") if weed_binary() is None else None
    bucket = request.getfixturevalue("test_bucket") if s3 is not None else ""
    poc = Poc(tmp_path / "poc", f"t{RUN_ID}-poc{n}", [f"p{RUN_ID}{n}-1", f"p{RUN_ID}{n}-2"],
              free_ports(1)[0], _env(amqp_url, redis_url, s3, bucket))
    try:
        yield poc
    finally:
        poc.run("poc", "stop", "--dir", str(poc.root))
        stop_marked(poc.root.resolve(), grace=3)
        delete_users(poc.users, CTL)
        Broker(amqp_url, poc.namespace).delete_all()
        delete_redis_namespace(redis_url, poc.namespace)


def leftovers(root: Path) -> list[str]:
    """Every process (but this one) that belongs to the POC folder: marked, started from it,
    or naming it on its command line."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            cwd = Path(proc.cwd())
            if (proc.environ().get(MARKER) == str(root) or root == cwd or root in cwd.parents
                    or any(str(root) in arg for arg in proc.cmdline())):
                found.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            continue
    return found


def running(pid: int, create_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - create_time) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def broker_users() -> set[str]:
    listed = subprocess.run([*CTL, "list_users", "--quiet", "--no-table-headers"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_start_status_stop_leaves_no_process(poc: Poc) -> None:
    started = poc.run("poc", "start", *poc.options)
    assert started.returncode == 0, started.stderr + started.stdout
    assert f"export FEDHIVE_CONFIG={poc.root / 'config'}" in started.stdout
    state = poc.state()
    root = Path(state["root"])
    names = [entry["name"] for entry in state["processes"]]
    assert names == [*(["seaweedfs"] if weed_binary() else []), "job-store", "scheduler",
                     "job-runner", "gateway", *(f"site-{site}" for site in poc.sites)]
    assert all(running(e["pid"], e["create_time"]) for e in state["processes"])
    assert set(state["broker_users"]) == set(poc.users) <= broker_users()
    broker = Broker(poc.env["FEDHIVE_AMQP_URL"], poc.namespace)
    site_queues = {Names(poc.namespace).site_queue(site) for site in poc.sites}
    assert site_queues <= set(broker.declared()[0])  # declared with the users: sites cannot

    status = poc.run("poc", "status", "--dir", str(poc.root), "--json")
    assert status.returncode == 0, status.stdout
    shown = json.loads(status.stdout)
    assert shown["healthy"] and shown["sites"] == dict.fromkeys(poc.sites, True)
    assert [p["name"] for p in shown["processes"] if p["alive"]] == names
    assert {site["name"] for site in poc.cli("sites") if site["online"]} == set(poc.sites)

    # a job running while the POC stops: its server job (which outlives the runner by design)
    # and client jobs run in sessions of their own and must be stopped too
    job = poc.cli("submit", str(EXAMPLES / "hello-pt"))["id"]
    recorded = {e["pid"] for e in state["processes"]}
    wait_for(lambda: poc.cli("job", job)["status"] == "RUNNING", timeout=60, interval=0.2,
             what="hello-pt to run")
    wait_for(lambda: len([p for p in leftovers(root) if int(p.split()[0]) not in recorded]) >= 2,
             timeout=30, what="the job's server and client jobs")

    stopped = poc.run("poc", "stop", "--dir", str(poc.root))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"Stopped {len(names)} process(es)")
    assert not [e["name"] for e in state["processes"] if running(e["pid"], e["create_time"])]
    assert leftovers(root) == []
    assert not set(poc.users) & broker_users()
    assert not site_queues & set(broker.declared()[0])  # deleted with the users
    assert not (poc.root / "state.json").exists()
    after = poc.run("poc", "status", "--dir", str(poc.root))
    assert after.returncode == 1 and "No POC is running" in after.stdout


# The two commands that start a POC (`make demo` runs the second), for tests of both.
STARTS = {"poc-start": ("poc", "start"),
          "demo": ("demo", "--local", "--examples", str(EXAMPLES))}
# Without a Docker engine (or its Compose plugin) the demo runs local processes by itself.
NO_COMPOSE = compose.why_no_engine()


@pytest.mark.parametrize("command", STARTS.values(), ids=STARTS.keys())
def test_a_taken_port_fails_cleanly_with_one_line(poc: Poc, command: tuple[str, ...]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", poc.port))
        taken.listen()
        done = poc.run(*command, *poc.options)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: port {poc.port} (gateway) is already in use: stop the program listening "
        "there, or pass --port with a free port"]
    assert leftovers(poc.root.resolve()) == []
    assert not (poc.root / "state.json").exists()
    assert not set(poc.users) & broker_users()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_runs_both_examples_and_stops_everything(poc: Poc, tmp_path: Path) -> None:
    record = tmp_path / "demo.json"
    local = [] if NO_COMPOSE else ["--local"]
    done = poc.run("demo", *local, *poc.options, "--examples", str(EXAMPLES), "--record",
                   str(record), timeout=280)
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]
    if NO_COMPOSE:
        assert done.stdout.startswith(f"No docker compose ({NO_COMPOSE}): running local "
                                      "processes.\n")
    for name in ("hello-numpy", "hello-pt"):
        assert f"{name}: round 3/3" in done.stdout
        assert f"{name}: FINISHED:COMPLETED" in done.stdout
    assert "fedhive metrics ID --plot curve.png" in done.stdout
    measured = json.loads(record.read_text())
    assert measured["demo_seconds"] > 0
    assert {name: job["status"] for name, job in measured["jobs"].items()} == {
        "hello-numpy": "FINISHED:COMPLETED", "hello-pt": "FINISHED:COMPLETED"}
    assert measured["jobs"]["hello-pt"]["final_metrics"]["accuracy"] >= 0.9
    results = poc.root / "results"
    assert len(list(results.glob("*/result.zip"))) == 2
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in results.glob("*/curve.png"))
    assert leftovers(poc.root.resolve()) == []
    assert not (poc.root / "state.json").exists()
    assert not set(poc.users) & broker_users()


def test_the_hierarchy_example_runs_across_two_tiers_and_stops_both(
        tmp_path: Path, amqp_url: str, redis_url: str, request: pytest.FixtureRequest) -> None:
    """`python examples/hierarchy/run.py` (the README's command): two POCs, hello-numpy across
    both tiers, each round's contributions per tier printed, everything stopped."""
    s3 = request.getfixturevalue("s3_server") if weed_binary() is None else None
    bucket = request.getfixturevalue("test_bucket") if s3 is not None else ""
    root = tmp_path / "hierarchy"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "hierarchy" / "run.py"), "--dir", str(root), "--ports",
         *map(str, free_ports(2))], env=_env(amqp_url, redis_url, s3, bucket),
        capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    for line in ("round 3/3", "tier 1 t1-site-1", "tier 1 t1-site-2", "tier 2 t2-site-1",
                 "tier 2 t2-site-2", "tier 1: FINISHED:COMPLETED", '"parent_job_id"',
                 "both tiers stopped"):
        assert line in done.stdout, done.stdout[-3000:]
    assert leftovers(root.resolve()) == []
