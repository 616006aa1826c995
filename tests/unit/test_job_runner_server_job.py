"""The server job's command line as the job-runner builds it: a resumed job's SJ is told which
job's checkpoint to continue from."""

from __future__ import annotations

from pathlib import Path

from fedhive.fl.server_job import parse_args
from fedhive.state.runs import RunEntry
from fedhive_services.job_runner.server_job import server_job_argv

ENTRY = RunEntry("new-job", "runner", 1, "starting", workspace="/w/new-job")


def test_a_fresh_job_gets_no_resume_argument() -> None:
    argv = server_job_argv(ENTRY, "/w/new-job/workspace", ["site-1", "site-2"], 0.5)
    assert "--resume-from" not in argv
    args = parse_args(argv)
    assert args.job_id == "new-job" and args.sites == ["site-1", "site-2"]
    assert args.app_dir == Path("/w/new-job/app") and args.liveness_interval == 0.5


def test_a_resumed_job_names_the_job_it_continues() -> None:
    argv = server_job_argv(ENTRY, "/w/new-job/workspace", ["site-1"], 1.0, "old-job")
    assert argv[-2:] == ["--resume-from", "old-job"]
    assert parse_args(argv).resume_from == "old-job"
