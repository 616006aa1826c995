"""`fedhive`: the admin command line.

Job and site commands (submit, jobs, job, clone, resume, delete, download, abort, watch,
sites; metrics in cli/metrics.py, logs in cli/logs.py) talk to the gateway through
`fedhive.sdk.Session` (cli/jobs.py; where the gateway is: cli/connection.py).
`simulate` runs a job on simulated sites in this process (cli/simulate.py). `validate` checks
a job offline, `config` the service environment, `admin-token` makes a token.
`poc start|status|stop` runs the whole system on this machine (cli/poc.py); `demo` runs the
examples on it (cli/demo.py). `watch` follows a job with its rounds (cli/watch.py).

Every command takes `--json` and exits with the codes of cli/exits.py (0 ok, 1 failed job or
other error, 2 usage, 3 not found, 4 denied, 5 unreachable). A command's module is imported
only when it runs (`Commands`, cli/lazy.py): `fedhive --help` loads none of them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, ClassVar

import typer
from rich.console import Console
from rich.table import Table

from fedhive import __version__
from fedhive.cli.connection import CONFIG_FILE_KEY, GatewayTarget
from fedhive.cli.exits import exit_code, fail, mapped, message
from fedhive.cli.lazy import LazyGroup
from fedhive.cli.options import JsonOpt
from fedhive.config import Settings
from fedhive.errors import FedhiveError


class Commands(LazyGroup):
    # Each command's module is imported when it runs; the line is what `fedhive --help` shows.
    lazy: ClassVar[dict[str, tuple[str, str]]] = {
        "validate": ("fedhive.cli.validate:validate", "Validate a job (meta.json, deploy map, "
                     "app configs, archive safety) without a server."),
        "admin-token": ("fedhive.cli.admins:admin_token", "Create a token: print it (give it "
                        "to the admin) and the entry for the admins file."),
        "submit": ("fedhive.cli.jobs:submit",
                   "Validate a job locally, upload it and print its id."),
        "jobs": ("fedhive.cli.jobs:jobs", "List jobs, newest first."),
        "job": ("fedhive.cli.jobs:job", "Show one job: meta, status, times and status history."),
        "clone": ("fedhive.cli.jobs:clone",
                  "Submit a copy of a job (new id, you as its submitter)."),
        "resume": ("fedhive.cli.jobs:resume", "Continue an aborted or failed job from its last "
                   "completed round (a new job)."),
        "delete": ("fedhive.cli.jobs:delete",
                   "Delete a finished job (its record and stored files)."),
        "download": ("fedhive.cli.jobs:download", "Download a job into OUTPUT/<id>/: job.zip, "
                     "meta.json and, if it has one, result.zip."),
        "abort": ("fedhive.cli.jobs:abort", "Abort a job."),
        "watch": ("fedhive.cli.watch:watch", "Follow a job until it is final: status, round k/N "
                  "and the latest metrics (a progress bar on a terminal; one JSON object per "
                  "change with --json). Exit 0 if it completed, 1 if not."),
        "metrics": ("fedhive.cli.metrics:metrics", "Show the per-round metrics a job recorded "
                    "(a table, JSON, or a plot with --plot)."),
        "sites": ("fedhive.cli.jobs:sites",
                  "List the sites that ever registered, with their liveness."),
        "logs": ("fedhive.cli.logs:logs", "Show a job's log lines: the server job's and each "
                 "site's client job and trainer."),
        "poc": ("fedhive.cli.poc:app",
                "Run the whole system on this machine (proof of concept)."),
        "demo": ("fedhive.cli.demo:demo", "Start the system, run hello-numpy and hello-pt with "
                 "live progress, summarise, stop it."),
        "simulate": ("fedhive.cli.simulate:simulate", "Run a job on simulated sites in this "
                     "process (no broker, Redis or S3): the job's own workflows, executors and "
                     "trainers, the quickest way to develop a job."),
    }


app = typer.Typer(cls=Commands, help="fedhive: run federated-learning jobs across sites.",
                  no_args_is_help=True)
_SECRET = (
    "amqp_url",
    "redis_url",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
)


@app.callback()
def gateway_options(
    ctx: typer.Context,
    gateway: Annotated[str | None, typer.Option(
        envvar="FEDHIVE_GATEWAY", help="Gateway address host:port.", show_envvar=True
    )] = None,
    token: Annotated[str | None, typer.Option(
        envvar="FEDHIVE_TOKEN", help="Admin bearer token.", show_envvar=True, show_default=False
    )] = None,
    ca_cert: Annotated[Path | None, typer.Option(
        envvar="FEDHIVE_GATEWAY_CA", help="CA certificate (PEM) to trust: TLS.", show_envvar=True
    )] = None,
    client_cert: Annotated[Path | None, typer.Option(
        envvar="FEDHIVE_CLIENT_CERT", help="Client certificate (PEM): mutual TLS.",
        show_envvar=True,
    )] = None,
    client_key: Annotated[Path | None, typer.Option(
        envvar="FEDHIVE_CLIENT_KEY", help="Client private key (PEM): mutual TLS.",
        show_envvar=True,
    )] = None,
    tls: Annotated[bool | None, typer.Option(
        "--tls/--no-tls", envvar="FEDHIVE_GATEWAY_TLS", help="TLS with the system's CAs.",
        show_envvar=True, show_default=False,
    )] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", envvar="FEDHIVE_CONFIG", help="CLI config file (TOML).",
        show_default="~/.fedhive/config", show_envvar=True, dir_okay=False,
    )] = None,
) -> None:
    """Where the gateway is; unset values come from the config file (~/.fedhive/config)."""
    ctx.obj = GatewayTarget(gateway or None, token or None, ca_cert, client_cert, client_key, tls)
    ctx.meta[CONFIG_FILE_KEY] = config_file


@app.command()
def version(as_json: JsonOpt = False) -> None:
    """Print the fedhive version."""
    typer.echo(json.dumps({"version": __version__}) if as_json else __version__)


@app.command()
def config(as_json: JsonOpt = False) -> None:
    """Validate the FEDHIVE_* environment and print the effective settings (secrets masked)."""
    try:
        settings = Settings.from_env()
    except FedhiveError as err:  # a ConfigError: exit 2
        raise fail(err) from None
    values = {k: _mask(k, v) for k, v in dataclasses.asdict(settings).items()}
    if as_json:
        typer.echo(json.dumps(values, indent=2))
        return
    table = Table("setting", "value")
    for key, value in values.items():
        table.add_row(key, "" if value is None else str(value))
    Console().print(table)


def _mask(key: str, value: object) -> object:
    if key not in _SECRET or value is None:
        return value
    if key.endswith("_url"):
        from urllib.parse import urlsplit

        parts = urlsplit(str(value))
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://***@{host}{port}{parts.path}"
    return "***"


def main() -> None:
    """The `fedhive` console script. Commands catch their errors themselves; this is the net
    for one that slips through: still one line and the mapped exit code, no traceback."""
    try:
        app()
    except Exception as err:
        if not mapped(err):
            raise
        typer.echo(f"error: {message(err)}", err=True)
        sys.exit(exit_code(err))
