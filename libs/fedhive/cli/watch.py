"""`fedhive watch JOB`: follow a job until its status is final, with its rounds.

It polls the job and the rounds its workflows recorded (`Session.get`, `Session.metrics`, what
`fedhive job` and `fedhive metrics` show) every `--interval` seconds, and shows each change:
a new status (or status-history entry) or a newly recorded round. A job-id prefix is resolved
by the first read; every later read names the full id.

* `--json`: one JSON object per change, on one line: the job's JSON (`render.job_json`) plus
  `round` (the latest recorded round, 1-based; 0 before the first), `num_rounds` (the latest
  round's workflow's total, null before the first round), `workflow` (null before it) and
  `metrics` (that round's aggregate metrics, {} before it).
* Otherwise one line per status change (`AT ID STATUS REASON`) and per recorded round (`AT ID
  round k/N WORKFLOW: metrics`); on a terminal also a live progress bar: round k/N, status,
  the latest metrics.

Exit code: 0 once the job is FINISHED:COMPLETED; 1 when it ends in any other final status (one
line on stderr says which and why); the error codes of `fedhive.cli.exits` when the job cannot
be read (3 unknown job, 5 gateway unreachable, ...); 130 after Ctrl-C.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Annotated, Any, Protocol

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from fedhive.cli.exits import Exit, fail_with
from fedhive.cli.jobs import _now_ms, _session
from fedhive.cli.options import JobId, JsonOpt
from fedhive.cli.render import iso, job_json, metrics_text
from fedhive.jobs.metrics import RoundMetrics
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus

DEFAULT_INTERVAL_S = 0.5


class JobReader(Protocol):
    """What `follow` reads (`fedhive.sdk.Session` has it)."""

    def get(self, job_id: str) -> JobRecord: ...

    def metrics(self, job_id: str) -> list[RoundMetrics]: ...


@dataclass(frozen=True)
class Snapshot:
    """The job and its recorded rounds, as one poll read them."""

    record: JobRecord
    rounds: list[RoundMetrics] = field(default_factory=list)

    @property
    def latest(self) -> RoundMetrics | None:
        return self.rounds[-1] if self.rounds else None

    @property
    def round(self) -> int:
        """The latest recorded round, 1-based (a resumed job's first is past 1); 0: none yet."""
        return self.latest.round + 1 if self.latest else 0

    @property
    def num_rounds(self) -> int | None:
        return self.latest.num_rounds if self.latest and self.latest.num_rounds > 0 else None

    @property
    def change(self) -> tuple[JobStatus, int, int]:
        """What a new snapshot must differ in to be shown."""
        return self.record.status, len(self.record.history), len(self.rounds)


def follow(reader: JobReader, job_id: str, interval: float,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[Snapshot]:
    """A snapshot now and at every change, ending with the first whose status is final.

    The record is read before the rounds, so the rounds read after a final record are all the
    job will ever have."""
    record = reader.get(job_id)
    job_id = record.job_id  # resolved once: a prefix given, the full id used from here on
    seen: tuple[JobStatus, int, int] | None = None
    while True:
        snapshot = Snapshot(record, reader.metrics(job_id))
        if snapshot.change != seen:
            seen = snapshot.change
            yield snapshot
        if record.status.is_final:
            return
        sleep(interval)
        record = reader.get(job_id)


def snapshot_json(snapshot: Snapshot, now_ms: int) -> dict[str, Any]:
    latest = snapshot.latest
    return {**job_json(snapshot.record, now_ms), "round": snapshot.round,
            "num_rounds": snapshot.num_rounds, "workflow": latest.workflow if latest else None,
            "metrics": latest.aggregate if latest else {}}


def outcome(record: JobRecord) -> Exit:
    """0 for a completed job, 1 for any other final status."""
    return Exit.OK if record.status is JobStatus.FINISHED_COMPLETED else Exit.FAILED


def status_line(record: JobRecord) -> str:
    at = iso(record.history[-1].at_ms) if record.history else None
    return f"{at or ''} {record.job_id} {record.status.value} {record.status_reason}".strip()


def round_line(job_id: str, entry: RoundMetrics) -> str:
    total = f"/{entry.num_rounds}" if entry.num_rounds > 0 else ""
    line = (f"{iso(entry.at_ms) or ''} {job_id} round {entry.round + 1}{total} "
            f"{entry.workflow}: {metrics_text(entry.aggregate) or '(no aggregate metrics)'}")
    return line.strip()


class LiveView:
    """The human output: lines for status changes and rounds and, on a terminal, a progress
    bar under them (round k/N, status, the latest metrics). Use it as a context manager."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.fields[rounds]}"), TextColumn("{task.fields[status]}"),
            TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=console,
            disable=not console.is_terminal,  # a log or a pipe gets the lines only
        )
        self._task: TaskID | None = None
        self._last: Snapshot | None = None

    def __enter__(self) -> LiveView:
        self.bar.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.bar.stop()

    def show(self, snapshot: Snapshot) -> None:
        record, last = snapshot.record, self._last
        status_at = record.history[-1].at_ms if record.history else 0
        # New rounds and a new status, in the order they happened (a round without a time:
        # just before the status).
        lines = [(entry.at_ms or status_at, 0, round_line(record.job_id, entry))
                 for entry in snapshot.rounds[len(last.rounds) if last else 0:]]
        if last is None or last.change[:2] != snapshot.change[:2]:
            lines.append((status_at, 1, status_line(record)))
        self._last = snapshot
        self._update_bar(snapshot)  # first: printing a line redraws the bar under it
        for _, _, line in sorted(lines):
            self.bar.console.print(line, soft_wrap=True, markup=False, highlight=False)

    def _update_bar(self, snapshot: Snapshot) -> None:
        record = snapshot.record
        rounds = f"round {snapshot.round}/{snapshot.num_rounds or '-'}"
        values = metrics_text(snapshot.latest.aggregate) if snapshot.latest else ""
        status = record.status.value
        if self._task is None:
            self._task = self.bar.add_task(record.job_id[:8], total=None, rounds=rounds,
                                           status=status, metrics=values)
        done = record.status is JobStatus.FINISHED_COMPLETED
        total = snapshot.num_rounds
        self.bar.update(self._task, total=total, completed=total if done else snapshot.round,
                        rounds=rounds, status=status, metrics=values)
        if record.status.is_final:
            self.bar.stop_task(self._task)
        self.bar.refresh()


def watch(
    ctx: typer.Context,
    job_id: JobId,
    as_json: JsonOpt = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.05, max=60, metavar="S",
        help="Seconds between reads of the job and its rounds.")] = DEFAULT_INTERVAL_S,
) -> None:
    """Follow a job until it is final: status, round k/N and the latest metrics (a progress bar
    on a terminal; one JSON object per change with --json). Exit 0 if it completed, 1 if not."""
    final: JobRecord | None = None
    try:
        with _session(ctx) as session:
            if as_json:
                for snapshot in follow(session, job_id, interval):
                    typer.echo(json.dumps(snapshot_json(snapshot, _now_ms())))
                    final = snapshot.record
            else:
                with LiveView(Console()) as view:
                    for snapshot in follow(session, job_id, interval):
                        view.show(snapshot)
                        final = snapshot.record
    except KeyboardInterrupt:
        raise typer.Exit(Exit.INTERRUPTED) from None
    assert final is not None  # follow yields at least once, ending with a final status
    code = outcome(final)
    if code != Exit.OK:
        reason = f": {final.status_reason}" if final.status_reason else ""
        raise fail_with(f"job {final.job_id} ended {final.status.value}{reason}", code)
