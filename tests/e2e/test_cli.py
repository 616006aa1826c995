"""`fedhive` end to end: the real CLI (a subprocess per command) against the real gateway and
job-store processes on real RabbitMQ, Redis and S3. There is no scheduler or job-runner here:
a test that needs a job to run or finish moves it in the state store itself and records its
rounds where a server job would (`fedhive.state.rounds`)."""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedhive.auth import AdminDirectory
from fedhive.blobs import S3BlobStore
from fedhive.jobs.metrics import RoundMetrics, round_to_dict
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.state import RedisStateStore
from fedhive.state.rounds import RoundLog
from tests.fixtures.gateway import GatewayStack
from tests.fixtures.infra import free_ports
from tests.fixtures.job_store import invalid_job_zip, job_zip

FEDHIVE = str(Path(sys.executable).parent / "fedhive")


class Cli:
    def __init__(self, stack: GatewayStack, home: Path) -> None:
        self.stack = stack
        self.home = home

    def run(self, *args: str, user: str = "lead@a", check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FEDHIVE, *args], env={**self.env(user), **(env or {})},
                              capture_output=True, text=True, timeout=60, check=False)
        if check:
            assert done.returncode == 0, done.stderr
        return done

    def json(self, *args: str, user: str = "lead@a") -> Any:
        return json.loads(self.run(*args, "--json", user=user).stdout)

    def env(self, user: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDHIVE_")}
        env.update(HOME=str(self.home), FEDHIVE_GATEWAY=self.stack.gateway.address,
                   FEDHIVE_TOKEN=self.stack.admins.tokens[user], COLUMNS="200")
        return env


@pytest.fixture
def cli(gateway_stack: GatewayStack, tmp_path: Path) -> Cli:
    return Cli(gateway_stack, tmp_path)


def _job_folder(root: Path, name: str) -> Path:
    folder = root / name
    with zipfile.ZipFile(io.BytesIO(job_zip(name))) as archive:
        archive.extractall(folder)
    return folder


def test_submit_list_get_clone_download_delete(cli: Cli, tmp_path: Path) -> None:
    submitted = cli.json("submit", str(_job_folder(tmp_path, "e2e-flow")))
    job_id = submitted["id"]
    assert submitted["existed"] is False

    listed = cli.json("jobs", "--name", "e2e-flow")
    assert [job["id"] for job in listed] == [job_id]
    assert listed[0]["status"] == "SUBMITTED" and listed[0]["submitter"] == "lead@a"
    assert job_id in cli.run("jobs", "--name", "e2e-flow").stdout  # the human table

    job = cli.json("job", job_id)
    assert (job["name"], job["org"], job["role"]) == ("e2e-flow", "a", "lead")
    assert job["deploy_map"] == {"srv": ["server"], "cli": ["site-1", "site-2"]}
    assert job["submit_time"].endswith("Z") and job["start_time"] is None
    assert [h["to"] for h in job["history"]] == ["SUBMITTED"]

    clone_id = cli.json("clone", job_id)["id"]
    assert cli.json("job", clone_id)["cloned_from"] == job_id

    refused = cli.run("download", job_id, "-o", str(tmp_path / "out"), check=False)
    assert refused.returncode == 1 and "not done" in refused.stderr
    assert cli.json("abort", job_id)["status"] == JobStatus.FINISHED_ABORTED.value
    files = cli.json("download", job_id, "-o", str(tmp_path / "out"))["files"]
    folder = tmp_path / "out" / job_id
    assert sorted(files) == sorted([str(folder / "job.zip"), str(folder / "meta.json")])
    with zipfile.ZipFile(folder / "job.zip") as archive:
        assert "cli/config/config_fed_client.json" in archive.namelist()
    assert json.loads((folder / "meta.json").read_text())["status"] == "FINISHED:ABORTED"

    running = cli.run("delete", clone_id, check=False)
    assert running.returncode == 1 and "could not be deleted" in running.stderr
    assert cli.run("delete", job_id).stdout.strip() == f"Job {job_id} deleted."
    gone = cli.run("job", job_id, check=False)
    assert gone.returncode == 3 and gone.stderr.count("\n") == 1 and "not found" in gone.stderr


def test_resume_an_aborted_job_from_its_checkpoint(cli: Cli, tmp_path: Path) -> None:
    job_id = cli.json("submit", str(_job_folder(tmp_path, "e2e-resume")))["id"]
    early = cli.run("resume", job_id, check=False)
    assert early.returncode == 1 and early.stderr == (
        f"error: job {job_id} is SUBMITTED; only ABORTED, EXECUTION_EXCEPTION or ABNORMAL "
        "jobs can be resumed\n"
    )
    cli.run("abort", job_id)
    nothing = cli.run("resume", job_id, check=False)
    assert nothing.returncode == 1
    assert nothing.stderr == f"error: job {job_id} completed no round: nothing to resume from\n"

    blobs = S3BlobStore.from_settings(cli.stack.settings)
    try:  # what the workflow leaves after a completed round
        blobs.put(Names(cli.stack.settings.namespace).job_checkpoint_key(job_id), b"round 1")
    finally:
        blobs.close()
    resumed = cli.json("resume", job_id)
    assert resumed["resumed_from"] == job_id and resumed["id"] != job_id
    shown = cli.json("job", resumed["id"])
    assert shown["resumed_from"] == job_id and shown["status"] == "SUBMITTED"
    assert shown["history"][0]["reason"] == f"resumed from job {job_id}"
    assert cli.json("job", job_id)["resumed_from"] is None
    human = cli.run("resume", job_id).stdout
    assert human.startswith(f"Resumed job {job_id} as: ")
    lines = cli.run("job", resumed["id"]).stdout.splitlines()
    assert [line.split() for line in lines if line.split()[:1] == ["resumed_from"]] == [
        ["resumed_from", job_id]
    ]


def test_watch_until_aborted(cli: Cli) -> None:
    job_id = cli.stack.gateway.session("lead@a").submit(job_zip("e2e-watch")).job_id
    watcher = subprocess.Popen([FEDHIVE, "watch", job_id.upper()[:13], "--json", "--interval",
                                "0.1"], env=cli.env("member@a"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout is not None
        first = json.loads(watcher.stdout.readline())
        assert first["status"] == "SUBMITTED"
        cli.run("abort", job_id, "--reason", "stop watching")
        out, err = watcher.communicate(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 1, err  # the job ended, but not FINISHED:COMPLETED
    assert err == f"error: job {job_id} ended FINISHED:ABORTED: stop watching\n"
    last = json.loads(out.strip().splitlines()[-1])
    assert (last["status"], last["status_reason"]) == ("FINISHED:ABORTED", "stop watching")
    assert (last["id"], last["round"], last["num_rounds"], last["metrics"]) == \
        (job_id, 0, None, {})


def test_denials_and_bad_tokens_are_one_line_errors(cli: Cli, tmp_path: Path) -> None:
    denied = cli.run("submit", str(_job_folder(tmp_path, "e2e-denied")), user="member@a",
                     check=False)
    assert denied.returncode == 4
    assert denied.stderr == ("error: user 'member@a' (member) is not authorized to submit: "
                             "role member has no submit_job\n")
    env = {**cli.env("lead@a"), "FEDHIVE_TOKEN": "fh_wrong"}
    bad = subprocess.run([FEDHIVE, "sites"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 4 and bad.stderr == "error: invalid bearer token\n"


def test_two_hundred_submissions_list_newest_first(cli: Cli) -> None:
    with cli.stack.gateway.session("lead@b") as session:
        ids = [session.submit(job_zip(f"e2e-many-{i:03d}")).job_id for i in range(200)]
        listed = session.list(name="e2e-many-", limit=200)
    assert [job.job_id for job in listed] == ids[::-1]
    assert [job.meta.name for job in listed[:2]] == ["e2e-many-199", "e2e-many-198"]
    assert cli.json("jobs", "--name", "e2e-many-", "-n", "3") == [
        cli.json("job", job_id) | {"duration_s": None} for job_id in ids[:-4:-1]
    ]


# exit codes, watch with rounds, job-id prefixes, --json, the narrow jobs table -----------------
@pytest.fixture
def state(cli: Cli) -> Iterator[tuple[RedisStateStore, RoundLog]]:
    """The stack's state store and round log: what the scheduler, the job-runner and a server
    job would write."""
    store = RedisStateStore.from_settings(cli.stack.settings)
    rounds = RoundLog.from_settings(cli.stack.settings)
    yield store, rounds
    store.close()
    rounds.close()


def _move(store: RedisStateStore, job_id: str, *path: JobStatus) -> None:
    for new in path:
        store.change_status(job_id, store.get_job(job_id).status, new, f"now {new.value}")


class _Lines:
    """A subprocess's stdout, line by line, read by a thread (a test never blocks on it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: [*map(self.lines.put, stdout), self.lines.put(None)],
                         daemon=True).start()

    def until(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while (line := self.lines.get(timeout=60)) is not None:
            change: dict[str, Any] = json.loads(line)
            if wanted(change):
                return change
        raise AssertionError("the watch ended before the change it waited for")


def test_exit_codes_by_error_class(cli: Cli, tmp_path: Path) -> None:
    """0 ok, 1 failed (generic error), 2 usage, 3 not found, 4 denied, 5 unreachable."""
    job_id = cli.json("submit", str(_job_folder(tmp_path, "e2e-exits")))["id"]
    assert cli.run("job", job_id).returncode == 0
    codes = {
        1: [cli.run("delete", job_id, check=False)],  # FailedPrecondition: it is SUBMITTED
        2: [cli.run("jobs", "-n", "-1", check=False),  # typer's usage error
            cli.run("job", "x" * 200, check=False),  # the gateway's InvalidArgument
            cli.run("submit", str(tmp_path / "missing"), check=False)],  # a bad input file
        3: [cli.run("job", "no-such-job", check=False),
            cli.run("download", "no-such-job", "-o", str(tmp_path), check=False)],
        4: [cli.run("abort", job_id, user="member@a", check=False),  # PermissionDenied
            cli.run("sites", env={"FEDHIVE_TOKEN": "fh_wrong"}, check=False)],  # Unauthenticated
        5: [cli.run("jobs", env={"FEDHIVE_GATEWAY": f"127.0.0.1:{free_ports(1)[0]}"},
                    check=False)],  # nothing listens: connection refused
    }
    bad = tmp_path / "bad.zip"
    bad.write_bytes(invalid_job_zip())
    codes[2].append(cli.run("submit", str(bad), check=False))
    for code, results in codes.items():
        for done in results:
            assert done.returncode == code, (done.args, done.stderr)
            assert done.stdout == "" and "Traceback" not in done.stderr
    # One line each ("error: ..."); typer's own usage message excepted, and a bad job: one
    # line per violation.
    usage, too_long, missing, broken = codes[2]
    assert "Usage: fedhive jobs" in usage.stderr
    for done in [*codes[1], too_long, *codes[3], *codes[4], *codes[5]]:
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert missing.stderr.endswith("missing: no such file or folder\n")
    assert missing.stderr.count("\n") == 1
    assert broken.stderr.count("\n") == 3  # invalid_job_zip breaks three rules
    assert codes[5][0].stderr.startswith("error: gateway 127.0.0.1:")


def test_watch_a_job_through_its_rounds_to_completed(
    cli: Cli, state: tuple[RedisStateStore, RoundLog]
) -> None:
    store, rounds = state
    job_id = cli.stack.gateway.session("lead@a").submit(job_zip("e2e-rounds")).job_id
    watcher = subprocess.Popen([FEDHIVE, "watch", job_id[:8], "--json", "--interval", "0.1"],
                               env=cli.env("member@a"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        changes = _Lines(watcher)
        assert changes.until(lambda c: True)["status"] == "SUBMITTED"
        _move(store, job_id, JobStatus.DISPATCHED, JobStatus.RUNNING)
        first = changes.until(lambda c: c["status"] == "RUNNING")
        assert (first["round"], first["num_rounds"]) == (0, None)
        rounds.append(job_id, round_to_dict(RoundMetrics(
            "sag", 0, 2, {"aggregate": {"accuracy": 0.5}, "sites": {}}, 1_700_000_000_000)))
        one = changes.until(lambda c: c["round"] == 1)
        assert (one["status"], one["num_rounds"], one["workflow"], one["metrics"]) == \
            ("RUNNING", 2, "sag", {"accuracy": 0.5})
        rounds.append(job_id, round_to_dict(RoundMetrics(
            "sag", 1, 2, {"aggregate": {"accuracy": 0.75, "loss": 0.5}, "sites": {}},
            1_700_000_001_000)))
        _move(store, job_id, JobStatus.FINISHED_COMPLETED)
        last = changes.until(lambda c: c["status"] == "FINISHED:COMPLETED")
        watcher.wait(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        watcher.wait()
    assert watcher.returncode == 0, watcher.stderr and watcher.stderr.read()
    assert (last["id"], last["round"], last["num_rounds"], last["metrics"]) == \
        (job_id, 2, 2, {"accuracy": 0.75, "loss": 0.5})
    # Once it is final, a watch (by a prefix, in capitals) shows it at once, as lines.
    lines = cli.run("watch", job_id[:8].upper()).stdout.splitlines()
    assert lines[:2] == [
        f"2023-11-14T22:13:20.000Z {job_id} round 1/2 sag: accuracy 0.5",
        f"2023-11-14T22:13:21.000Z {job_id} round 2/2 sag: accuracy 0.75 · loss 0.5",
    ]
    assert len(lines) == 3
    assert lines[2].endswith(f"Z {job_id} FINISHED:COMPLETED now FINISHED:COMPLETED")


def test_job_id_prefixes_in_every_job_command(cli: Cli, tmp_path: Path) -> None:
    """A unique prefix (any case) names the job; an ambiguous one is a usage error naming the
    matches, an unknown one is not found; what is printed names the full id."""
    first, second = ("e2ecafe1-0000-4000-8000-000000000001",
                     "e2ecafe2-0000-4000-8000-000000000002")
    with cli.stack.gateway.session("lead@a") as lead:
        lead.submit(job_zip("e2e-prefix"), job_id=first)
        lead.submit(job_zip("e2e-prefix"), job_id=second)
    assert cli.json("job", "E2ECAFE1")["id"] == first
    assert cli.json("metrics", "e2ecafe1") == {"id": first, "rounds": []}
    assert cli.json("clone", "e2ecafe1")["cloned_from"] == first
    assert cli.run("clone", "E2ECAFE1").stdout.startswith(f"Cloned job {first} as: ")
    ambiguous = cli.run("abort", "e2ecafe", check=False)
    assert ambiguous.returncode == 2
    assert ambiguous.stderr == (f"error: job id prefix e2ecafe is ambiguous: it matches {first}, "
                                f"{second}; give more of the id\n")
    unknown = cli.run("job", "e2ecafe3", check=False)
    assert unknown.returncode == 3 and unknown.stderr == "error: job e2ecafe3 not found\n"
    assert cli.json("abort", "e2ecafe1")["id"] == first
    assert cli.run("watch", "e2ecafe1", check=False).returncode == 1  # ended ABORTED
    files = cli.json("download", "E2ECAFE1", "-o", str(tmp_path))["files"]
    assert files == [str(tmp_path / first / name) for name in ("job.zip", "meta.json")]
    assert cli.run("delete", "e2ecafe1").stdout == f"Job {first} deleted.\n"
    assert cli.json("job", "e2ecafe")["id"] == second  # unique again


def test_json_on_the_commands_that_need_no_gateway(cli: Cli, tmp_path: Path) -> None:
    valid = cli.json("validate", str(_job_folder(tmp_path, "e2e-valid")))
    assert (valid["valid"], valid["name"]) == (True, "e2e-valid")
    bad = tmp_path / "bad.zip"
    bad.write_bytes(invalid_job_zip())
    invalid = cli.run("validate", str(bad), "--json", check=False)
    assert invalid.returncode == 2 and json.loads(invalid.stdout)["valid"] is False
    assert len(json.loads(invalid.stdout)["violations"]) == 3
    made = cli.json("admin-token", "erin@e.org", "--org", "e", "--role", "lead")
    assert AdminDirectory.parse({"admins": [made["entry"]]}).authenticate(made["token"])
    assert set(cli.json("version")) == {"version"}
    assert cli.json("config")["namespace"]


def test_jobs_table_keeps_statuses_whole_on_a_narrow_console(
    cli: Cli, state: tuple[RedisStateStore, RoundLog]
) -> None:
    store, _ = state
    with cli.stack.gateway.session("lead@a") as lead:
        ids = [lead.submit(job_zip("e2e-narrow-table-with-a-long-name")).job_id
               for _ in range(2)]
    _move(store, ids[0], JobStatus.DISPATCHED, JobStatus.RUNNING,
          JobStatus.FINISHED_EXECUTION_EXCEPTION)
    for columns in ("60", "80", "120"):
        table = cli.run("jobs", "--name", "e2e-narrow", env={"COLUMNS": columns}).stdout
        lines = table.splitlines()
        assert all(len(line) <= int(columns) for line in lines)
        for job_id, status in zip(ids, ("FINISHED:EXECUTION_EXCEPTION", "SUBMITTED"),
                                  strict=True):
            row = next(line for line in lines if job_id[:6] in line)
            assert f" {status} " in row, (columns, table)
