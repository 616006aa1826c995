"""`fedhive poc start` and `fedhive demo` (what `make demo` runs) on a machine that lacks what
they need: RabbitMQ, Redis or the S3 server absent and not installable, the disk full before
the start or filling during it (or during the demo's jobs), a port taken while it starts,
Ctrl-C. Each ends within its timeout with exit code 1 (130 after Ctrl-C) and one line on stderr
naming what is missing and the fix, no traceback, and nothing left: no process of the POC
folder, no new child of this test, no broker user, no state file. (tests/e2e/test_poc.py has
the port taken before the start.)

A missing program is hidden by PATH: the command sees only the virtual environment's bin and a
folder of the test's own. A full disk is a tmpfs mounted on the POC folder (as root; skipped
where mount is refused: tests/unit/test_poc.py checks the same lines on a patched disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fedhive.poc.procs import stop_marked
from tests.e2e import test_poc
from tests.e2e.test_poc import (
    EXAMPLES,
    FEDHIVE,
    NO_COMPOSE,
    STARTS,
    Poc,
    broker_users,
    leftovers,
)
from tests.fixtures.infra import free_ports, wait_for

poc = test_poc.poc  # the fixture: a POC folder, namespace, site names and port of the test's own

HIDDEN = ("rabbitmq-server", "rabbitmqctl", "redis-server", "apt-get", "brew")


def bare_path(tmp_path: Path, **tools: str) -> str:
    """PATH with the virtual environment's bin and a folder holding only `tools` (name: shell
    script): none of HIDDEN but those."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, script in tools.items():
        (folder / name).write_text(f"#!/bin/sh\n{script}\n")
        (folder / name).chmod(0o755)
    path = f"{Path(sys.executable).parent}{os.pathsep}{folder}"
    # a RabbitMQ or Redis found here would be started (or installed) for real
    assert not [name for name in HIDDEN if name not in tools and shutil.which(name, path=path)]
    return path


def children() -> set[int]:
    return {proc.pid for proc in psutil.Process().children(recursive=True)}


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    """Exit `code`, and stderr is the one line `line` (a regular expression)."""
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == code, done.stderr + done.stdout[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(line, lines[0]), done.stderr


def assert_nothing_left(poc: Poc, before: set[int]) -> None:
    assert leftovers(poc.root.resolve()) == []
    assert children() <= before
    assert not (poc.root / "state.json").exists()
    assert not set(poc.sites) & broker_users()


def _default_sigint() -> None:
    """As a terminal's foreground command has it: a test run started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Running:
    """A CLI command in a process group of its own, as a shell runs it (a Ctrl-C at the
    terminal reaches the whole group); stdout read line by line while it runs."""

    def __init__(self, args: list[str], env: dict[str, str], stderr: Path) -> None:
        self._stderr = stderr.open("w+")
        self.proc = subprocess.Popen([FEDHIVE, *args], env={**env, "PYTHONUNBUFFERED": "1"},
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     process_group=0, preexec_fn=_default_sigint)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ended = False  # the reader's end mark was taken
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, text: str, timeout: float) -> None:
        """Until a line of stdout holds `text`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout} s: "
                                     f"{''.join(self.stdout)}") from None
            if line is None:
                self._ended = True
                raise AssertionError(f"ended before {text!r}: {self._finish(30).stderr}")
            self.stdout.append(line)
            if text in line:
                return

    def interrupt(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s: "
                                 f"{''.join(self.stdout)}") from None
        return self._finish(timeout)

    def _finish(self, timeout: float) -> subprocess.CompletedProcess[str]:
        self.proc.wait(timeout)
        while not self._ended and (line := self._lines.get(timeout=5)) is not None:
            self.stdout.append(line)
        self._ended = True
        self._stderr.seek(0)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           "".join(self.stdout), self._stderr.read())


@contextlib.contextmanager
def small_disk(poc: Poc, mib: int) -> Iterator[None]:
    """A tmpfs of `mib` MiB mounted on the POC folder for the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small disk needs root (mount -t tmpfs)")
    poc.root.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs",
                              str(poc.root)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield
    finally:
        stop_marked(poc.root.resolve(), grace=3)  # nothing may keep it busy
        if subprocess.run(["umount", str(poc.root)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(poc.root)], check=True)


def fill(folder: Path) -> None:
    """Write to `folder` until its disk is full."""
    with (folder / "filler").open("wb", buffering=0) as out:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    out.write(bytes(size))
            except OSError as err:  # full for this size: on with smaller writes
                if err.errno != errno.ENOSPC:
                    raise


def absent_url(scheme: str) -> str:
    port = free_ports(1)[0]
    return {"amqp": f"amqp://guest:guest@127.0.0.1:{port}/%2F",
            "redis": f"redis://127.0.0.1:{port}/0", "http": f"http://127.0.0.1:{port}"}[scheme]


@pytest.mark.parametrize("command", STARTS.values(), ids=STARTS.keys())
def test_rabbitmq_absent_and_no_package_manager(poc: Poc, tmp_path: Path,
                                                command: tuple[str, ...]) -> None:
    before = children()
    env = {**poc.env, "FEDHIVE_AMQP_URL": absent_url("amqp"), "PATH": bare_path(tmp_path)}
    done = poc.run(*command, *poc.options, env=env, timeout=60)
    assert_one_line(done, 1, re.escape(
        "error: RabbitMQ is not installed (rabbitmq-server not found): install rabbitmq-server "
        "with your package manager, or set FEDHIVE_AMQP_URL to a RabbitMQ that runs"))
    assert_nothing_left(poc, before)


@pytest.mark.skipif(os.geteuid() != 0, reason="apt is tried as root only")
def test_rabbitmq_absent_and_apt_fails(poc: Poc, tmp_path: Path) -> None:
    """As root on a Debian machine apt installs it; here apt cannot (no such package, as on a
    machine with no network or no repository for it)."""
    calls = tmp_path / "apt-calls"
    apt = (f'echo "$*" >> {calls}\n'
           'if [ "$1" = install ]; then echo "E: Unable to locate package $4" >&2; exit 100; fi')
    policy = Path("/usr/sbin/policy-rc.d")
    policy_before = policy.read_bytes() if policy.exists() else None
    before = children()
    env = {**poc.env, "FEDHIVE_AMQP_URL": absent_url("amqp"),
           "PATH": bare_path(tmp_path, **{"apt-get": apt})}
    done = poc.run("poc", "start", *poc.options, env=env, timeout=60)
    assert_one_line(done, 1, re.escape(
        "error: RabbitMQ is not installed and `apt-get install -y -q rabbitmq-server` failed "
        "(E: Unable to locate package rabbitmq-server): make apt work and run `apt-get install "
        "-y rabbitmq-server`, or set FEDHIVE_AMQP_URL to a RabbitMQ that runs"))
    assert calls.read_text().splitlines() == ["update -q", "install -y -q rabbitmq-server"]
    assert (policy.read_bytes() if policy.exists() else None) == policy_before
    assert_nothing_left(poc, before)


def test_redis_absent(poc: Poc, tmp_path: Path) -> None:
    before = children()
    env = {**poc.env, "FEDHIVE_REDIS_URL": absent_url("redis"), "PATH": bare_path(tmp_path)}
    done = poc.run("poc", "start", *poc.options, env=env, timeout=60)
    assert_one_line(done, 1, re.escape(
        "error: Redis is not installed (redis-server not found): install redis-server with your "
        "package manager, or set FEDHIVE_REDIS_URL to a Redis that runs"))
    assert_nothing_left(poc, before)


def test_the_s3_server_named_is_absent(poc: Poc) -> None:
    url = absent_url("http")
    before = children()
    env = {**poc.env, "FEDHIVE_S3_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}
    done = poc.run("poc", "start", *poc.options, env=env, timeout=60)
    assert_one_line(done, 1, re.escape(
        f"error: S3 does not answer at {url} (FEDHIVE_S3_ENDPOINT_URL): start it, or unset "
        "FEDHIVE_S3_ENDPOINT_URL to use the embedded SeaweedFS"))
    assert_nothing_left(poc, before)


def _disk_full(poc: Poc, how: str) -> str:
    return re.escape("error: disk full: ") + how + re.escape(
        f" on the disk of {poc.root.resolve()}, a POC needs 512 MiB: free some space, or pass "
        "--dir on another disk")


@pytest.mark.parametrize("command", STARTS.values(), ids=STARTS.keys())
def test_a_full_disk_before_the_start(poc: Poc, command: tuple[str, ...]) -> None:
    before = children()
    with small_disk(poc, 64):
        done = poc.run(*command, *poc.options, timeout=60)
        assert_one_line(done, 1, _disk_full(poc, r"\d+ MiB free"))
        assert_nothing_left(poc, before)


def test_the_disk_filling_during_the_start(poc: Poc, tmp_path: Path) -> None:
    """Enough space at the check; full once the S3 server runs and the broker users are being
    made: the writes after fail, and what was started is stopped."""
    before = children()
    with small_disk(poc, 520):
        start = Running(["poc", "start", *poc.options], poc.env, tmp_path / "stderr")
        start.wait_for("poc: creating broker users", timeout=60)
        fill(poc.root)
        done = start.finish(timeout=60)
        assert_one_line(done, 1, _disk_full(poc, r"(no space left|\d+ MiB free)"))
        assert "poc: stopping what was started" in done.stdout
        assert_nothing_left(poc, before)


def test_the_gateway_port_taken_while_starting(poc: Poc, tmp_path: Path) -> None:
    """Free at the check, taken before the gateway listens (another program was faster): the
    S3 server runs and the services start, and all are stopped. Taken while the broker users
    are made, before any service is spawned: a gateway that starts fast must not win the race."""
    before = children()
    start = Running(["poc", "start", *poc.options], poc.env, tmp_path / "stderr")
    with socket.socket() as taken:
        start.wait_for("poc: creating broker users", timeout=60)
        taken.bind(("127.0.0.1", poc.port))
        taken.listen()
        done = start.finish(timeout=60)
    assert_one_line(done, 1, re.escape(
        f"error: port {poc.port} (gateway) is already in use: stop the program listening there, "
        "or pass --port with a free port"))
    assert "poc: stopping what was started" in done.stdout
    assert_nothing_left(poc, before)


def test_ctrl_c_while_the_poc_starts(poc: Poc, tmp_path: Path) -> None:
    before = children()
    start = Running(["poc", "start", *poc.options], poc.env, tmp_path / "stderr")
    start.wait_for("poc: waiting for the services to start", timeout=60)
    start.interrupt()
    done = start.finish(timeout=60)
    assert_one_line(done, 130, re.escape(
        "error: interrupted: stopped everything the POC had started"))
    assert_nothing_left(poc, before)


@pytest.mark.timeout(180)
def test_ctrl_c_while_the_demo_runs_a_job(poc: Poc, tmp_path: Path) -> None:
    """The job's server job and client jobs run in sessions of their own: stopped too."""
    before = children()
    demo = Running(["demo", "--local", *poc.options, "--examples", str(EXAMPLES)], poc.env,
                   tmp_path / "stderr")
    demo.wait_for("hello-pt: RUNNING", timeout=120)
    root = poc.root.resolve()
    recorded = {entry["pid"] for entry in poc.state()["processes"]}
    wait_for(lambda: len([p for p in leftovers(root) if int(p.split()[0]) not in recorded]) >= 2,
             timeout=30, what="the job's server and client jobs")
    demo.interrupt()
    done = demo.finish(timeout=60)
    assert_one_line(done, 130, re.escape(
        "error: interrupted: stopped everything the demo had started"))
    assert_nothing_left(poc, before)


@pytest.mark.timeout(180)
def test_the_disk_filling_while_the_demo_runs(poc: Poc, tmp_path: Path) -> None:
    """Whatever fails of it (a job, a download), the disk is named. The disk fills once the
    first job is submitted (its RUNNING, a second or two, can fall between two polls)."""
    before = children()
    with small_disk(poc, 520):
        demo = Running(["demo", "--local", *poc.options, "--examples", str(EXAMPLES)], poc.env,
                       tmp_path / "stderr")
        demo.wait_for("hello-numpy: submitted as job", timeout=120)
        fill(poc.root)
        done = demo.finish(timeout=60)
        assert_one_line(done, 1, _disk_full(poc, r"(no space left|\d+ MiB free)"))
        assert_nothing_left(poc, before)


@pytest.mark.skipif(NO_COMPOSE is None, reason="a Docker engine answers here")
def test_the_demo_insisting_on_docker_compose_without_an_engine(poc: Poc) -> None:
    before = children()
    done = poc.run("demo", "--compose", *poc.options, "--examples", str(EXAMPLES), timeout=60)
    assert_one_line(done, 1, re.escape(
        f"error: --compose needs docker compose: {NO_COMPOSE}: start Docker, or leave out "
        "--compose to run local processes"))
    assert_nothing_left(poc, before)
    assert not (poc.root / "compose.env").exists()
