"""`fedhive` end to end: the real CLI (a subprocess per command) against the real gateway and
job-store processes on real RabbitMQ, Redis and S3."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from tests.fixtures.gateway import GatewayStack
from tests.fixtures.job_store import job_zip

FEDHIVE = str(Path(sys.executable).parent / "fedhive")


class Cli:
    def __init__(self, stack: GatewayStack, home: Path) -> None:
        self.stack = stack
        self.home = home

    def run(self, *args: str, user: str = "lead@a", check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([FEDHIVE, *args], env=self.env(user), capture_output=True,
                              text=True, timeout=60, check=False)
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
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1 and "not found" in gone.stderr


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
    watcher = subprocess.Popen([FEDHIVE, "watch", job_id, "--json"], env=cli.env("member@a"),
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
    assert watcher.returncode == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert (last["status"], last["status_reason"]) == ("FINISHED:ABORTED", "stop watching")


def test_denials_and_bad_tokens_are_one_line_errors(cli: Cli, tmp_path: Path) -> None:
    denied = cli.run("submit", str(_job_folder(tmp_path, "e2e-denied")), user="member@a",
                     check=False)
    assert denied.returncode == 1
    assert denied.stderr == ("error: user 'member@a' (member) is not authorized to submit: "
                             "role member has no submit_job\n")
    env = {**cli.env("lead@a"), "FEDHIVE_TOKEN": "fh_wrong"}
    bad = subprocess.run([FEDHIVE, "sites"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 1 and bad.stderr == "error: invalid bearer token\n"


def test_two_hundred_submissions_list_newest_first(cli: Cli) -> None:
    with cli.stack.gateway.session("lead@b") as session:
        ids = [session.submit(job_zip(f"e2e-many-{i:03d}")).job_id for i in range(200)]
        listed = session.list(name="e2e-many-", limit=200)
    assert [job.job_id for job in listed] == ids[::-1]
    assert [job.meta.name for job in listed[:2]] == ["e2e-many-199", "e2e-many-198"]
    assert cli.json("jobs", "--name", "e2e-many-", "-n", "3") == [
        cli.json("job", job_id) | {"duration_s": None} for job_id in ids[:-4:-1]
    ]
