"""`fedhive poc start|status|stop`: the whole system on this machine (fedhive.poc).

Progress goes to stdout (with `--json`: to stderr, and stdout gets one JSON object); a failure
is one line on stderr (what is missing and the fix) after everything the command started was
stopped, with the exit code `fedhive.cli.exits` maps it to (1 for a POC that cannot start, 2 for
bad settings, ...). Ctrl-C: the same, exit 130.

JSON: `start`: {dir, gateway, namespace, sites, s3_endpoint, embedded_s3, config, export,
logs}; `status`: `fedhive.poc.status.poc_status`; `stop`: {dir, running (false: nothing was),
stopped, killed, strays, problems}.
"""

from __future__ import annotations

import dataclasses
import shlex
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedhive.cli.exits import Exit, exit_code, fail, fail_with
from fedhive.cli.options import JsonOpt, print_json
from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.poc.layout import PocLayout
from fedhive.poc.status import poc_status
from fedhive.poc.stop import StopReport, stop_poc

if TYPE_CHECKING:  # loaded by `start` only: S3, broker users and the services' commands are
    from fedhive.poc.start import PocOptions, Started  # not every command's start-up cost

app = typer.Typer(help="Run the whole system on this machine (proof of concept).",
                  no_args_is_help=True)

DirOpt = Annotated[Path | None, typer.Option(
    "--dir", help="The POC's folder (state, logs, sites, config).",
    show_default="~/.fedhive/poc", file_okay=False)]
CtlOpt = Annotated[str, typer.Option(
    "--rabbitmqctl", help="Command that runs rabbitmqctl (broker users), e.g. 'sudo rabbitmqctl'.")]


def _fail(message: str, code: int = Exit.FAILED) -> typer.Exit:
    return fail_with(message, Exit(code))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def interrupt_on_sigterm() -> None:
    """SIGTERM acts like Ctrl-C: whatever was started is stopped before the command ends."""
    signal.signal(signal.SIGTERM, _interrupt)


def _settings() -> Settings:
    try:
        return Settings.from_env()
    except FedhiveError as err:  # a ConfigError: exit 2
        raise fail(err) from None


@app.command()
def start(
    sites: Annotated[int, typer.Option("--sites", min=1, max=64,
                                       help="How many site agents.")] = 2,
    directory: DirOpt = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535,
                                      help="The gateway's port on 127.0.0.1.")] = 50051,
    namespace: Annotated[str, typer.Option(
        "--namespace", help="Prefix of the POC's queues, keys and objects.")] = "poc",
    site_prefix: Annotated[str, typer.Option(
        "--site-prefix", help="Sites are named PREFIX1 ... PREFIXn (also their broker users).",
    )] = "site-",
    timeout: Annotated[float, typer.Option(
        "--timeout", min=1, help="Seconds to wait for each step (S3, services, sites).")] = 90,
    rabbitmqctl: CtlOpt = "rabbitmqctl",
    as_json: JsonOpt = False,
) -> None:
    """Start RabbitMQ and Redis if needed, an S3 server, the services and the site agents."""
    from fedhive.poc.start import PocOptions

    options = PocOptions(directory, sites, site_prefix, namespace, port, timeout,
                         tuple(shlex.split(rabbitmqctl)))
    interrupt_on_sigterm()
    started = run_start(options, _settings(), progress_to_stderr=as_json)
    if as_json:
        print_json(started_json(started))
    else:
        print_usage(started)


def run_start(options: PocOptions, settings: Settings, *, progress_to_stderr: bool = False
              ) -> Started:
    """`start_poc` with progress on stdout (or stderr) and failures as one line on stderr."""
    from fedhive.poc.start import start_poc

    try:
        return start_poc(options, settings,
                         say=lambda line: typer.echo(f"poc: {line}", err=progress_to_stderr))
    except FedhiveError as err:
        raise fail(err) from None
    except KeyboardInterrupt:
        raise _fail("interrupted: stopped everything the POC had started",
                    Exit.INTERRUPTED) from None
    except OSError as err:
        raise fail_with(f"{err.filename}: {err.strerror}" if err.filename else str(err),
                        exit_code(err)) from None
    except Exception as err:  # a bug: still one line, after everything started was stopped
        raise _fail(f"the POC did not start ({type(err).__name__}: {err}); everything it had "
                    "started was stopped: please report it") from None


def print_usage(started: Started) -> None:
    state, layout = started.state, started.layout
    s3 = ("embedded SeaweedFS" if state.embedded_s3 else "FEDHIVE_S3_ENDPOINT_URL")
    typer.echo(
        f"\nfedhive POC is up in {layout.root}\n"
        f"  gateway {state.gateway} · sites {', '.join(state.sites)} online · namespace "
        f"{state.namespace} · S3 {state.s3_endpoint or 'AWS'} ({s3})\n\n"
        f"Use it as the POC admin (project_admin):\n"
        f"  export FEDHIVE_CONFIG={layout.cli_config}\n"
        f"  fedhive submit examples/hello-numpy\n"
        f"  fedhive jobs; fedhive sites; fedhive metrics ID --plot curve.png\n\n"
        f"fedhive poc status{_dir_arg(layout)}  ·  fedhive poc stop{_dir_arg(layout)}  ·  "
        f"logs in {layout.logs}")


def started_json(started: Started) -> dict[str, Any]:
    state, layout = started.state, started.layout
    return {"dir": str(layout.root), "gateway": state.gateway, "namespace": state.namespace,
            "sites": state.sites, "s3_endpoint": state.s3_endpoint,
            "embedded_s3": state.embedded_s3, "config": str(layout.cli_config),
            "export": f"export FEDHIVE_CONFIG={layout.cli_config}", "logs": str(layout.logs)}


def _dir_arg(layout: PocLayout) -> str:
    return "" if layout == PocLayout.at(None) else f" --dir {layout.root}"


@app.command()
def status(
    directory: DirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Each process of the POC alive or not, and each site online or not (exit 1 if not all)."""
    layout = PocLayout.at(directory)
    try:
        shown = poc_status(layout)
    except FedhiveError as err:
        raise fail(err) from None
    if as_json:
        print_json(shown)
    else:
        _print_status(shown)
    if not shown["healthy"]:
        raise typer.Exit(1)


def _print_status(shown: dict[str, Any]) -> None:
    if not shown["running"]:
        typer.echo(f"No POC is running in {shown['dir']}.")
        return
    table = Table("process", "pid", "state", title=f"POC in {shown['dir']}")
    for proc in shown["processes"]:
        table.add_row(proc["name"], str(proc["pid"]),
                      "[green]alive[/]" if proc["alive"] else "[red]gone[/]")
    for site, online in shown["sites"].items():
        table.add_row(f"site {site}", "", "[green]online[/]" if online else "[red]offline[/]")
    Console().print(table)
    typer.echo(f"gateway {shown['gateway']} · CLI config {shown['config']}")


@app.command()
def stop(
    directory: DirOpt = None,
    infra: Annotated[bool, typer.Option(
        "--infra", help="Also stop the RabbitMQ and Redis that `poc start` started.")] = False,
    rabbitmqctl: CtlOpt = "rabbitmqctl",
    as_json: JsonOpt = False,
) -> None:
    """Stop every process the POC started (and their children); delete its broker users."""
    layout = PocLayout.at(directory)
    try:
        report = stop_poc(layout, _settings(), tuple(shlex.split(rabbitmqctl)), infra_too=infra)
    except FedhiveError as err:
        raise fail(err) from None
    if as_json:
        print_json({"dir": str(layout.root), "running": report is not None,
                     **dataclasses.asdict(report or StopReport())})
    elif report is None:
        typer.echo(f"No POC is running in {layout.root}.")
    else:
        print_stopped(report)


def print_stopped(report: StopReport, *, err: bool = False) -> None:
    killed = f" ({', '.join(report.killed)} needed SIGKILL)" if report.killed else ""
    strays = f"; {report.strays} leftover process(es) stopped" if report.strays else ""
    typer.echo(f"Stopped {len(report.stopped)} process(es){killed}{strays}.", err=err)
    for problem in report.problems:
        typer.echo(f"warning: {problem}", err=True)
