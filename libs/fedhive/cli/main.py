"""`fedhive`: the admin command line.

Job commands (submit, list, abort, ...) talk to the gateway and arrive with the jobs issue; today
the CLI validates a job offline and shows the version and the effective configuration, which
already catches a bad environment before any service is started.
"""

from __future__ import annotations

import dataclasses
import json

import typer
from rich.console import Console
from rich.table import Table

from fedhive import __version__
from fedhive.cli.validate import validate
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


@app.command()
def version() -> None:
    """Print the fedhive version."""
    typer.echo(__version__)


@app.command()
def config(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Validate the FEDHIVE_* environment and print the effective settings (secrets masked)."""
    try:
        settings = Settings.from_env()
    except FedhiveError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
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
    app()
