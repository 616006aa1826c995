"""What several `fedhive` commands share and that costs nothing to import: the `--json` option,
the job-id argument, JSON output. Kept out of the command modules so that a command loads only
its own module (`fedhive.cli.lazy`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (a stable schema).")]
JobId = Annotated[str, typer.Argument(help="The job's id, or a unique prefix of it (any case).")]


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))
