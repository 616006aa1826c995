"""`fedhive validate PATH`: check a job folder or zip offline, with the gateway's own rules.

Exit 0 with a one-line summary for a valid job; exit 1 with one line per violation on stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedhive.errors import FedhiveError
from fedhive.jobs.archive import Violations
from fedhive.jobs.definition import load_job


def validate(
    path: Annotated[Path, typer.Argument(help="A job folder, a job zip, or a single app folder.")],
) -> None:
    """Validate a job (meta.json, deploy map, app configs, archive safety) without a server."""
    try:
        job = load_job(path)
    except Violations as err:
        for line in err.violations:
            typer.echo(line, err=True)
        raise typer.Exit(1) from None
    except (FedhiveError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"valid: {job.summary()}")
