"""`fedhive`: the admin command line.

Job and site commands (submit, jobs, job, clone, resume, delete, download, abort, watch,
sites; metrics in cli/metrics.py, logs in cli/logs.py) talk to the gateway through
`fedhive.sdk.Session` (cli/jobs.py; where the gateway is: cli/connection.py).
`simulate` runs a job on simulated sites in this process (cli/simulate.py). `validate` checks
a job offline, `config` the service environment, `admin-token` makes a token.
`poc start|status|stop` runs the whole system on this machine (cli/poc.py); `demo` runs the
examples on it (cli/demo.py). `watch` follows a job with its rounds (cli/watch.py).

Every command takes `--json` and exits with the codes of cli/exits.py (0 ok, 1 failed job or
other error, 2 usage, 3 not found, 4 denied, 5 unreachable).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import grpc
import typer
from rich.console import Console
from rich.table import Table

from fedhive import __version__
from fedhive.cli import jobs, poc
from fedhive.cli.admins import admin_token
from fedhive.cli.connection import GatewayTarget
from fedhive.cli.demo import demo
from fedhive.cli.exits import exit_code, fail, message
from fedhive.cli.jobs import CONFIG_FILE_KEY, JsonOpt
from fedhive.cli.logs import logs
from fedhive.cli.metrics import metrics
from fedhive.cli.simulate import simulate
from fedhive.cli.validate import validate
from fedhive.cli.watch import watch
from fedhive.config import Settings
from fedhive.errors import FedhiveError

app = typer.Typer(help="fedhive: run federated-learning jobs across sites.", no_args_is_help=True)
_SECRET = (
    "amqp_url",
    "redis_url",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
)


app.command("validate")(validate)
app.command("admin-token")(admin_token)
for _command in (jobs.submit, jobs.jobs, jobs.job, jobs.clone, jobs.resume, jobs.delete,
                 jobs.download, jobs.abort, watch, metrics, jobs.sites):
    app.command()(_command)
app.command()(logs)
app.add_typer(poc.app, name="poc")
app.command()(demo)
app.command()(simulate)


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
    except (FedhiveError, OSError, grpc.RpcError) as err:
        typer.echo(f"error: {message(err)}", err=True)
        sys.exit(exit_code(err))
