"""`fedhive simulate JOB -n SITES`: run a job on simulated sites in this process, no services.

Prints one line per finished round (`round k/N WORKFLOW: metrics`, as `fedhive watch` does)
and, at the end, the job's final status and the files it left in `WORKSPACE/<id>/`
(`fedhive.simulate.run`: job.zip, result.zip and meta.json as `fedhive download` writes them).
`--json` prints one object at the end instead: the job (`fedhive job --json`'s fields) with
`folder` and `files`. Exit 0 when the job completed, 1 when it ended otherwise, 2 for a job or
options that do not fit (one line per problem), 130 after Ctrl-C (the job is then aborted and
its files are still written).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fedhive.cli.exits import Exit, fail
from fedhive.cli.render import job_json
from fedhive.cli.watch import round_line
from fedhive.errors import FedhiveError
from fedhive.jobs.metrics import RoundMetrics

if TYPE_CHECKING:  # the FL runtime (numpy, the workflows) loads when a simulation runs, not
    from fedhive.fl.workflow import RoundReport  # for every `fedhive` command
    from fedhive.simulate import Simulated

_FILES = ("job.zip", "result.zip", "meta.json")


def simulate(
    job: Annotated[Path, typer.Argument(help="A job folder or zip (as for submit).")],
    num_sites: Annotated[int | None, typer.Option(
        "-n", "--num-sites", help="Simulate this many sites, named site-1..N.")] = None,
    sites: Annotated[str, typer.Option(
        "--sites", help="Or name them: comma-separated site names.")] = "",
    threads: Annotated[int | None, typer.Option(
        "-t", "--threads", min=1, help="Sites running a task at the same time (default: all).",
    )] = None,
    workspace: Annotated[Path, typer.Option(
        "--workspace", "-w", help="Folder for the run's files (WORKSPACE/<job id>/).")] =
    Path("simulate"),
    log_level: Annotated[str, typer.Option(
        "--log-level", help="Level of WORKSPACE/<job id>/simulate.log.")] = "INFO",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] =
    False,
) -> None:
    """Run a job on simulated sites in this process (no broker, Redis or S3): the job's own
    workflows, executors and trainers, the quickest way to develop a job."""
    from fedhive.simulate import Options
    from fedhive.simulate import simulate as run_simulation

    names = tuple(name.strip() for name in sites.split(",") if name.strip())
    options = Options(num_sites=num_sites, sites=names, threads=threads, workspace=workspace,
                      log_level=log_level.upper())
    abort = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: abort.set())
    try:
        done = run_simulation(job, options, abort=abort,
                              on_round=None if as_json else _print_round)
    except (FedhiveError, OSError) as err:
        raise fail(err) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    if as_json:
        typer.echo(json.dumps(result_json(done)))
    else:
        record = done.record
        typer.echo(f"Job {record.job_id}: {record.status.value} ({record.status_reason})")
        for name in _FILES:
            typer.echo(str(done.folder / name))
    if abort.is_set():
        raise typer.Exit(Exit.INTERRUPTED)
    raise typer.Exit(Exit.OK if done.completed else Exit.FAILED)


def result_json(done: Simulated) -> dict[str, Any]:
    return {**job_json(done.record, int(time.time() * 1000)), "folder": str(done.folder),
            "files": [str(done.folder / name) for name in _FILES]}


def _print_round(report: RoundReport) -> None:
    entry = RoundMetrics(report.workflow, report.round, report.num_rounds,
                         report.metrics if isinstance(report.metrics, dict) else {},
                         int(time.time() * 1000))
    typer.echo(round_line("", entry).replace("  ", " "))
