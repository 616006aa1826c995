"""`fedhive watch` without a gateway: following a scripted job (status changes and recorded
rounds), the JSON per change, the lines and the progress bar, and the exit code by the final
status. Also the `jobs` table on a narrow console. (Against a real gateway:
tests/e2e/test_cli.py.)"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fedhive.cli.connection import GatewayTarget
from fedhive.cli.main import app
from fedhive.cli.render import jobs_table
from fedhive.cli.watch import LiveView, Snapshot, follow, outcome, snapshot_json
from fedhive.errors import NotFound
from fedhive.jobs.metrics import RoundMetrics
from fedhive.jobs.record import JobMeta, JobRecord, StatusChange, Submitter
from fedhive.jobs.status import JobStatus

runner = CliRunner()
S = JobStatus
JOB = "3f2c1a9e-1234-4abc-9def-0123456789ab"
AT = 1_700_000_000_000


def _record(status: JobStatus, reason: str = "", job_id: str = JOB) -> JobRecord:
    path = {S.SUBMITTED: [S.SUBMITTED], S.RUNNING: [S.SUBMITTED, S.DISPATCHED, S.RUNNING]}.get(
        status, [S.SUBMITTED, S.DISPATCHED, S.RUNNING, status])
    history = [StatusChange(old, new, reason if new is status else "", AT + i * 1000)
               for i, (old, new) in enumerate(zip([None, *path], path, strict=False))]
    return JobRecord(job_id=job_id, meta=JobMeta(name="watched", deploy_map={}), status=status,
                     submitter=Submitter("lead@a", "a", "lead"), submit_time_ms=AT,
                     history=history)


def _round(index: int, total: int = 3, **aggregate: Any) -> RoundMetrics:
    return RoundMetrics("sag", index, total, {"aggregate": aggregate, "sites": {}},
                        AT + 10_000 + index)


class ScriptedJob:
    """Stands in for `fedhive.sdk.Session`: each poll (get, then metrics) answers the next
    step of the script; the last step repeats."""

    def __init__(self, steps: list[tuple[JobRecord, list[RoundMetrics]]]) -> None:
        self.steps = steps
        self.polls = 0
        self.asked: list[tuple[str, str]] = []

    def get(self, job_id: str) -> JobRecord:
        self.asked.append(("get", job_id))
        if not JOB.startswith(job_id.lower()):
            raise NotFound(f"job {job_id} not found", field="job_id")
        self.polls = min(self.polls + 1, len(self.steps))
        return self.steps[self.polls - 1][0]

    def metrics(self, job_id: str) -> list[RoundMetrics]:
        self.asked.append(("metrics", job_id))
        return self.steps[self.polls - 1][1]

    def __enter__(self) -> ScriptedJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None


COMPLETED = [
    (_record(S.SUBMITTED), []),
    (_record(S.SUBMITTED), []),  # no change: not shown again
    (_record(S.RUNNING), []),
    (_record(S.RUNNING), [_round(0, accuracy=0.5)]),
    (_record(S.RUNNING), [_round(0, accuracy=0.5)]),
    (_record(S.RUNNING), [_round(0, accuracy=0.5), _round(1, accuracy=0.7),
                          _round(2, loss=0.25, accuracy=0.9)]),
    (_record(S.FINISHED_COMPLETED, "done"), [_round(0, accuracy=0.5), _round(1, accuracy=0.7),
                                             _round(2, loss=0.25, accuracy=0.9)]),
]
ABORTED = [(_record(S.RUNNING), [_round(0, accuracy=0.5)]),
           (_record(S.FINISHED_ABORTED, "stop it"), [_round(0, accuracy=0.5)])]


def test_follow_yields_each_change_and_ends_at_the_final_status() -> None:
    job = ScriptedJob(COMPLETED)
    sleeps: list[float] = []
    seen = list(follow(job, "3F2C", 0.25, sleep=sleeps.append))
    assert [(s.record.status, s.round, s.num_rounds) for s in seen] == [
        (S.SUBMITTED, 0, None), (S.RUNNING, 0, None), (S.RUNNING, 1, 3), (S.RUNNING, 3, 3),
        (S.FINISHED_COMPLETED, 3, 3),
    ]
    assert sleeps == [0.25] * (len(COMPLETED) - 1)
    # The prefix is resolved by the first read; every later read names the full id.
    assert job.asked[0] == ("get", "3F2C") and {i for _, i in job.asked[1:]} == {JOB}


def test_a_job_already_final_is_shown_once() -> None:
    seen = list(follow(ScriptedJob(ABORTED[1:]), JOB, 1.0, sleep=pytest.fail))
    assert len(seen) == 1 and seen[0].record.status is S.FINISHED_ABORTED


def test_snapshot_json_is_the_job_plus_its_latest_round() -> None:
    snapshot = Snapshot(_record(S.RUNNING), [_round(0, accuracy=0.5), _round(1, accuracy=0.7)])
    values = snapshot_json(snapshot, AT + 60_000)
    assert values["id"] == JOB and values["status"] == "RUNNING"
    assert list(values)[-4:] == ["round", "num_rounds", "workflow", "metrics"]
    assert (values["round"], values["num_rounds"], values["workflow"], values["metrics"]) == \
        (2, 3, "sag", {"accuracy": 0.7})
    before = snapshot_json(Snapshot(_record(S.SUBMITTED)), AT)
    assert (before["round"], before["num_rounds"], before["workflow"], before["metrics"]) == \
        (0, None, None, {})
    json.dumps(values)


@pytest.mark.parametrize(("status", "code"), [
    (S.FINISHED_COMPLETED, 0), (S.FINISHED_ABORTED, 1), (S.FINISHED_EXECUTION_EXCEPTION, 1),
    (S.FINISHED_ABNORMAL, 1), (S.FINISHED_CANT_SCHEDULE, 1), (S.FINISHED_FAILED_TO_RUN, 1),
])
def test_only_a_completed_job_exits_0(status: JobStatus, code: int) -> None:
    assert outcome(_record(status)) == code


def test_live_view_on_a_terminal_shows_lines_and_a_progress_bar() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    job = ScriptedJob(COMPLETED)
    with LiveView(console) as view:
        for snapshot in follow(job, JOB, 0, sleep=lambda _: None):
            view.show(snapshot)
    text = out.getvalue()
    for expected in (f"{JOB} SUBMITTED", f"{JOB} RUNNING", f"{JOB} round 1/3 sag: accuracy 0.5",
                     f"{JOB} round 3/3 sag: accuracy 0.9 · loss 0.25",
                     f"{JOB} FINISHED:COMPLETED done"):
        assert expected in text, expected
    assert "━" in text and "round 3/3" in text  # the bar, with round k/N beside it


# the command ------------------------------------------------------------------------------------
@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FEDHIVE_GATEWAY", "127.0.0.1:9")
    monkeypatch.setenv("FEDHIVE_TOKEN", "x")

    def install(steps: list[tuple[JobRecord, list[RoundMetrics]]]) -> ScriptedJob:
        job = ScriptedJob(steps)
        monkeypatch.setattr(GatewayTarget, "open", lambda self: job)
        return job

    return install


def test_watch_json_prints_one_object_per_change_and_exits_0_when_completed(
    scripted: Any
) -> None:
    scripted(COMPLETED)
    result = runner.invoke(app, ["watch", "3f2c", "--json", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    changes = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(c["status"], c["round"], c["num_rounds"]) for c in changes] == [
        ("SUBMITTED", 0, None), ("RUNNING", 0, None), ("RUNNING", 1, 3), ("RUNNING", 3, 3),
        ("FINISHED:COMPLETED", 3, 3),
    ]
    assert changes[-1]["metrics"] == {"accuracy": 0.9, "loss": 0.25}
    assert {c["id"] for c in changes} == {JOB} and result.stderr == ""


def test_watch_exits_1_when_the_job_ends_otherwise(scripted: Any) -> None:
    scripted(ABORTED)
    result = runner.invoke(app, ["watch", JOB, "--interval", "0.05"])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].endswith(f"{JOB} RUNNING") and f"{JOB} round 1/3 sag: accuracy 0.5" in \
        lines[1]
    assert lines[-1].endswith(f"{JOB} FINISHED:ABORTED stop it")
    assert result.stderr == f"error: job {JOB} ended FINISHED:ABORTED: stop it\n"
    scripted(ABORTED)
    as_json = runner.invoke(app, ["watch", JOB, "--json", "--interval", "0.05"])
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout.splitlines()[-1])["status"] == "FINISHED:ABORTED"


def test_watch_of_an_unknown_job_exits_3(scripted: Any) -> None:
    scripted(COMPLETED)
    result = runner.invoke(app, ["watch", "0000"])
    assert result.exit_code == 3 and result.stderr == "error: job 0000 not found\n"


# the jobs table ---------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [50, 60, 80, 100, 120, 200])
def test_jobs_table_never_cuts_a_status(width: int) -> None:
    jobs = [replace(_record(status), job_id=f"{i}f2c1a9e-1234-4abc-9def-0123456789ab",
                    meta=JobMeta(name="a-rather-long-job-name-for-the-column", deploy_map={}))
            for i, status in enumerate(S)]
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    console.print(jobs_table(jobs, AT + 5_000, console.width))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= width for line in lines)
    for job in jobs:  # each status whole, on its job's first line
        first = next(line for line in lines if job.job_id[:4] in line)
        assert f" {job.status.value} " in first, (width, job.status)
    if width >= 100:  # and the ids too, once they fit beside the statuses
        assert all(any(job.job_id in line for line in lines) for job in jobs)
    if width >= 160:
        assert "not shown" not in out.getvalue() and "Run Duration" in out.getvalue()
