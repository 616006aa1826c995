"""`fedhive validate PATH`: check a job folder or zip offline, with the gateway's own rules.

Exit 0 with a one-line summary for a valid job; exit 2 (a bad input file, `fedhive.cli.exits`)
with one line per violation on stderr.

`--json` prints `{path, valid: true, name, apps, deploy_map, sites, min_clients, summary}` for a
valid job and `{path, valid: false, violations: [...]}` for an invalid one (same exit codes;
stderr stays empty). `sites` is `"@ALL"` for a job deployed to every site.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from fedhive.cli.exits import exit_code, fail, message
from fedhive.errors import FedhiveError
from fedhive.jobs.archive import Violations
from fedhive.jobs.definition import JobDefinition, load_job
from fedhive.jobs.validation import ALL_SITES


def validate(
    path: Annotated[Path, typer.Argument(help="A job folder, a job zip, or a single app folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (a stable schema).")] =
    False,
) -> None:
    """Validate a job (meta.json, deploy map, app configs, archive safety) without a server."""
    try:
        job = load_job(path)
    except (FedhiveError, OSError) as err:
        if not as_json:
            raise fail(err) from None
        problems = err.violations if isinstance(err, Violations) else [message(err)]
        typer.echo(json.dumps({"path": str(path), "valid": False, "violations": problems}))
        raise typer.Exit(exit_code(err)) from None
    if as_json:
        typer.echo(json.dumps(valid_json(path, job)))
    else:
        typer.echo(f"valid: {job.summary()}")


def valid_json(path: Path, job: JobDefinition) -> dict[str, Any]:
    return {"path": str(path), "valid": True, "name": job.meta.name, "apps": job.apps,
            "deploy_map": job.meta.deploy_map,
            "sites": ALL_SITES if job.deploys_to_all else job.sites,
            "min_clients": job.meta.min_clients, "summary": job.summary()}
