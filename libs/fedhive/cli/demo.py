"""`fedhive demo` (what `make demo` runs): the whole system, then examples/hello-numpy and
examples/hello-pt with live progress, a summary, and the system stopped again. The system is
the docker-compose deployment when a Docker engine answers (`--compose` insists on it), local
processes (a POC) otherwise, with `--local`, or where there is no docker-compose.yml (an installed
wheel outside the repository).

Live: one progress bar per job (status, round k/N, the last round's aggregate metrics) and a
line per finished round, from the job record and the rounds `fedhive metrics` shows (polled
through the SDK). Summary: rounds, final metrics (accuracy), time, where each result and
training curve is (curves need matplotlib, the `plot` extra: without it the summary says so
and draws none). Exit 0 only if both jobs completed; 1 otherwise (one line says why); 130
after Ctrl-C (or SIGTERM), which stops everything the demo started (`docker compose down -v`
for the compose project).

`--record FILE` writes {"demo_seconds": from the command's start to both jobs finished, ...}
(bench/results/demo.json for the benchmark figure).

`--json`: the progress and the summary go to stderr, and stdout gets one JSON object once the
jobs ended: {demo_seconds, poc_start_seconds, completed (both jobs), jobs: [{name, id, status,
reason, round, num_rounds, final_metrics, seconds, result, curve}]} (paths or null). Exit codes
are the same; errors map as `fedhive.cli.exits` says (e.g. 5 when the gateway stops answering).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import psutil
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedhive import extras
from fedhive.cli.exits import Exit, exit_code, fail, fail_with, message
from fedhive.cli.metrics import plot_series, write_plot
from fedhive.cli.options import JsonOpt, print_json
from fedhive.cli.poc import (
    CtlOpt,
    DirOpt,
    _fail,
    _settings,
    interrupt_on_sigterm,
    print_stopped,
    run_start,
)
from fedhive.cli.render import metrics_text
from fedhive.config import Settings
from fedhive.errors import FedhiveError, PocFailed
from fedhive.poc import checks, compose
from fedhive.poc.demo import (
    EXAMPLES,
    JobProgress,
    check_example_needs,
    find_examples,
    run_job,
    save_result,
)
from fedhive.poc.layout import PocLayout
from fedhive.poc.status import cli_token, poc_status
from fedhive.poc.stop import shielded, stop_poc
from fedhive.sdk import Session

if TYPE_CHECKING:  # loaded when the demo runs (as `fedhive poc start` does)
    from fedhive.poc.start import PocOptions


@dataclass
class _System:
    """What the demo runs its jobs on, and how it ends."""

    gateway: str
    token: str
    stop: Callable[[], None]  # takes down what the demo started (nothing when it was running)
    afterwards: str  # the summary's last line: how to see a job's curve later


def demo(
    directory: DirOpt = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535,
                                      help="The gateway's port on 127.0.0.1.")] = 50051,
    namespace: Annotated[str, typer.Option(
        "--namespace", help="The POC's namespace (with docker compose: project fedhive-NAME).")]
    = "poc",
    site_prefix: Annotated[str, typer.Option(
        "--site-prefix", help="The two sites are PREFIX1 and PREFIX2 (local processes).")] =
    "site-",
    examples: Annotated[Path | None, typer.Option(
        "--examples", help="Folder with hello-numpy and hello-pt.", show_default="./examples",
        file_okay=False)] = None,
    record: Annotated[Path | None, typer.Option(
        "--record", metavar="FILE", help="Write the wall time to FILE (JSON, demo_seconds).",
        dir_okay=False)] = None,
    keep: Annotated[bool, typer.Option(
        "--keep", help="Leave the system running at the end.")] = False,
    use_compose: Annotated[bool | None, typer.Option(
        "--compose/--local", help="Run the system with docker compose (needs a Docker engine) "
        "or as local processes.", show_default="docker compose when a Docker engine answers")]
    = None,
    rabbitmqctl: CtlOpt = "rabbitmqctl",
    as_json: JsonOpt = False,
) -> None:
    """Start the system, run hello-numpy and hello-pt with live progress, summarise, stop it."""
    from fedhive.poc.start import PocOptions

    began = psutil.Process().create_time()
    console = Console(stderr=as_json)  # with --json, stdout holds only the JSON
    settings = _settings()
    try:
        folder = find_examples(examples)
        check_example_needs()
        if use_compose is False:
            no_engine: str | None = "--local"
        else:  # auto: local processes where there is no compose file either (a wheel)
            no_engine = compose.why_no_engine() or (None if use_compose else _no_compose_file())
        if use_compose and no_engine:
            raise PocFailed(f"--compose needs docker compose: {no_engine}: start Docker, or "
                            "leave out --compose to run local processes")
    except FedhiveError as err:
        raise fail(err) from None
    interrupt_on_sigterm()
    options = PocOptions(directory, 2, site_prefix, namespace, port,
                         rabbitmqctl=tuple(shlex.split(rabbitmqctl)))
    layout = PocLayout.at(options.root)
    if no_engine is None:
        system = _compose(layout, options, keep, console)
    else:
        if use_compose is None:
            console.print(f"No docker compose ({no_engine}): running local processes.",
                          soft_wrap=True)
        system = _poc(options, settings, keep, console)
    poc_seconds = time.time() - began
    jobs: list[JobProgress] = []
    results: dict[str, Path] = {}
    demo_seconds = 0.0
    interrupted, failure = False, None
    try:
        with Session(system.gateway, system.token) as session:
            jobs = _run_jobs(session, folder, console)
            demo_seconds = time.time() - began
            results = {job.job_id: save_result(session, job.job_id, layout.results)
                       for job in jobs if job.completed}
    except KeyboardInterrupt:
        interrupted = True
    except Exception as err:  # whatever it is, the system is stopped before the one line
        failure = err
    with shielded():
        system.stop()
    if interrupted:
        raise _fail("interrupted: stopped everything the demo had started", Exit.INTERRUPTED)
    if failure is not None or not all(job.completed for job in jobs):
        try:
            checks.blame_the_disk(layout.root, failure)
        except PocFailed as err:
            raise fail(err) from None
    if failure is not None:
        raise _fail(f"the demo failed: {message(failure)}", exit_code(failure))
    no_plot = extras.missing("matplotlib")
    curves = {} if no_plot else {job.job_id: _curve(job, layout) for job in jobs}
    _summary(console, jobs, results, curves, demo_seconds, system.afterwards)
    if no_plot:
        console.print(f"No curves drawn: {extras.needs('a training curve', no_plot)}",
                      soft_wrap=True, markup=False)  # markup would eat the [plot]
    if record is not None:
        _record(record, demo_seconds, poc_seconds, jobs)
    if as_json:
        print_json(demo_json(jobs, results, curves, demo_seconds, poc_seconds))
    failed = [job for job in jobs if not job.completed]
    if failed:
        raise _fail("; ".join(f"{job.name} ended {job.status.value}: {job.reason}"
                              for job in failed))


def _no_compose_file() -> str | None:
    """Why an answering engine still cannot run the compose deployment: no docker-compose.yml
    here nor in a checkout (fedhive installed from its wheel); None when there is one."""
    try:
        compose.find_compose_dir()
    except PocFailed as err:
        return str(err)
    return None


def _poc(options: PocOptions, settings: Settings, keep: bool, console: Console) -> _System:
    """A running POC in the folder is used (and left running); otherwise one is started."""
    layout = PocLayout.at(options.root)
    try:
        shown = poc_status(layout)
    except FedhiveError as err:
        raise fail(err) from None
    use = f"export FEDHIVE_CONFIG={layout.cli_config}"
    token = cli_token(layout) if shown["running"] and shown["healthy"] else None
    if token:
        console.print(f"Using the POC running in {layout.root} (gateway {shown['gateway']}).")
        return _System(str(shown["gateway"]), token, lambda: None, f"(after `{use}`).")
    console.print(f"[bold]Starting a POC[/] in {layout.root} …")
    started = run_start(options, settings, progress_to_stderr=console.stderr)
    if keep:
        return _System(started.state.gateway, started.token, lambda: None, f"(after `{use}`).")
    again = "fedhive poc start" + ("" if layout == PocLayout.at(None) else
                                   f" --dir {layout.root}")
    return _System(started.state.gateway, started.token,
                   lambda: _stop(layout, settings, options, console),
                   f"with the POC running (`{again}` brings it back with these jobs; then "
                   f"`{use}`).")


def _compose(layout: PocLayout, options: PocOptions, keep: bool, console: Console) -> _System:
    """The compose project fedhive-NAMESPACE: used (and left running) when it runs with its env
    file in the demo's folder; otherwise started, and taken down at the end."""
    try:
        stack = compose.ComposeStack(compose.find_compose_dir(), layout.root / "compose.env",
                                     f"fedhive-{options.namespace}")
        if stack.env_file.is_file() and stack.running():
            console.print(f"Using the compose project {stack.project} (gateway {stack.gateway}).")
            token = stack.settings()["FEDHIVE_TOKEN"]
        else:
            console.print(f"[bold]Starting docker compose[/] (env file {stack.env_file}) …")
            with console.status("docker compose …"):  # a spinner on a terminal
                token = compose.start_stack(stack, options.port,
                                            say=lambda line: console.print(f"compose: {line}"))
            if not keep:
                return _System(stack.gateway, token, lambda: _down(stack, console),
                               "with the system running (these jobs went with `docker compose "
                               "down -v`; `fedhive demo --compose --keep` leaves them).")
    except FedhiveError as err:
        raise fail(err) from None
    except OSError as err:  # the env file could not be written, or docker could not run
        raise fail_with(f"{err.filename}: {err.strerror}" if err.filename else str(err),
                        exit_code(err)) from None
    except KeyboardInterrupt:
        raise _fail("interrupted: stopped everything the demo had started",
                    Exit.INTERRUPTED) from None
    return _System(stack.gateway, token, lambda: None,
                   f"(after `export FEDHIVE_GATEWAY={stack.gateway} FEDHIVE_TOKEN=...`, the "
                   f"token in {stack.env_file}); stop it with `{stack.hint('down', '-v')}`.")


def _run_jobs(session: Session, folder: Path, console: Console) -> list[JobProgress]:
    bars = Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description:<12}"), BarColumn(),
        TextColumn("{task.fields[rounds]:<11}"), TextColumn("{task.fields[status]:<20}"),
        TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=console,
        disable=not console.is_terminal,  # a log (CI, a pipe) gets the lines below only
    )
    tasks: dict[str, TaskID] = {}
    shown: dict[str, tuple[int, str]] = {}  # job -> (rounds printed, status printed)
    jobs = []

    def update(job: JobProgress) -> None:
        if job.job_id not in tasks:
            tasks[job.job_id] = bars.add_task(job.name, total=None, rounds="round -/-",
                                              status="", metrics="")
            bars.console.print(f"{job.name}: submitted as job {job.job_id}", soft_wrap=True)
            shown[job.job_id] = (0, "")
        printed_rounds, printed_status = shown[job.job_id]
        for entry in job.rounds[printed_rounds:]:
            bars.console.print(f"{job.name}: round {entry.round + 1}/{entry.num_rounds} "
                               f"{metrics_text(entry.aggregate)} ({len(entry.sites)} sites)",
                               soft_wrap=True)
        if job.status.value != printed_status:
            bars.console.print(f"{job.name}: {job.status.value}"
                               f"{' — ' + job.reason if job.reason else ''}", soft_wrap=True)
        shown[job.job_id] = (len(job.rounds), job.status.value)
        total = job.num_rounds
        bars.update(tasks[job.job_id], total=total, completed=job.done,
                    rounds=f"round {job.done}/{total or '-'}", status=job.status.value,
                    metrics=metrics_text(job.final_metrics))
        if job.ended is not None:
            bars.stop_task(tasks[job.job_id])

    with bars:
        for name in EXAMPLES:
            jobs.append(run_job(session, folder / name, update))
    return jobs


def _stop(layout: PocLayout, settings: Settings, options: PocOptions, console: Console) -> None:
    console.print("Stopping the POC …")
    try:
        report = stop_poc(layout, settings, options.rabbitmqctl, infra_too=True)
    except FedhiveError as err:
        console.print(f"[red]stopping the POC: {err}[/]")
        return
    if report is not None:
        print_stopped(report, err=console.stderr)


def _down(stack: compose.ComposeStack, console: Console) -> None:
    console.print(f"Stopping compose project {stack.project} (down -v) …")
    problem = stack.down()
    if problem is not None:
        console.print(f"[red]docker compose down: {problem}: run `{stack.hint('down', '-v')}`[/]")
    stack.env_file.unlink(missing_ok=True)


def _curve(job: JobProgress, layout: PocLayout) -> Path | None:
    series = plot_series(job.rounds)
    if not series:
        return None
    path = layout.results / job.job_id / "curve.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_plot(path, job.job_id, series)
    except (OSError, ValueError):
        return None
    return path


def _summary(console: Console, jobs: list[JobProgress], results: dict[str, Path],
             curves: dict[str, Path | None], seconds: float, afterwards: str) -> None:
    table = Table("job", "status", "rounds", "final metrics", "time", title="fedhive demo")
    table.columns[1].no_wrap = True
    for job in jobs:
        colour = "green" if job.completed else "red"
        table.add_row(job.name, f"[{colour}]{job.status.value}[/]",
                      f"{job.done}/{job.num_rounds or '-'}", metrics_text(job.final_metrics),
                      f"{job.seconds:.1f} s")
    console.print(table)
    accuracy = next((job.final_metrics.get("accuracy") for job in reversed(jobs)
                     if isinstance(job.final_metrics.get("accuracy"), float)), None)
    if accuracy is not None:
        console.print(f"Final accuracy (hello-pt, held-out test split): [bold]{accuracy:.3f}[/]")
    console.print(f"Wall time: [bold]{seconds:.1f} s[/] from `fedhive demo` to both jobs "
                  "finished")
    for job in jobs:
        console.print(f"{job.name} (job {job.job_id}):", soft_wrap=True)
        if job.job_id in results:
            console.print(f"  result  {results[job.job_id]}  (metrics.json, model, logs)",
                          soft_wrap=True)
        curve = curves.get(job.job_id)
        if curve is not None:
            console.print(f"  curve   {curve}", soft_wrap=True)
    console.print("A job's training curve, any time: `fedhive metrics ID --plot curve.png` "
                  + afterwards, soft_wrap=True)


def demo_json(jobs: list[JobProgress], results: dict[str, Path],
              curves: dict[str, Path | None], demo_seconds: float, poc_seconds: float
              ) -> dict[str, Any]:
    def path(value: Path | None) -> str | None:
        return None if value is None else str(value)

    return {"demo_seconds": round(demo_seconds, 2), "poc_start_seconds": round(poc_seconds, 2),
            "completed": bool(jobs) and all(job.completed for job in jobs),
            "jobs": [{"name": job.name, "id": job.job_id, "status": job.status.value,
                      "reason": job.reason,
                      "round": job.rounds[-1].round + 1 if job.rounds else 0,
                      "num_rounds": job.num_rounds, "final_metrics": job.final_metrics,
                      "seconds": round(job.seconds, 2), "result": path(results.get(job.job_id)),
                      "curve": path(curves.get(job.job_id))} for job in jobs]}


def _record(path: Path, demo_seconds: float, poc_seconds: float, jobs: list[JobProgress]) -> \
        None:
    values = {"demo_seconds": round(demo_seconds, 2), "poc_start_seconds": round(poc_seconds, 2),
              "jobs": {job.name: {"seconds": round(job.seconds, 2), "status": job.status.value,
                                  "rounds": job.done, "final_metrics": job.final_metrics}
                       for job in jobs}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=2) + "\n")
