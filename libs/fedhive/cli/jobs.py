"""The job and site commands of `fedhive`: thin wrappers over `fedhive.sdk.Session`.

Errors are one line on stderr (the gateway's message; a job that fails local validation: one
line per violation) and end the command with the exit code `fedhive.cli.exits` maps the error
to: 2 usage (including missing or invalid gateway settings and a bad job), 3 not found, 4
denied, 5 unreachable, 1 anything else. Wherever a job id is taken, a unique prefix of one
(any case) is too: the job-store resolves it, and what the command prints names the full id.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fedhive.cli.connection import CONFIG_FILE, CONFIG_FILE_KEY, GatewayTarget, load_config_file
from fedhive.cli.exits import fail, mapped
from fedhive.cli.options import JobId, JsonOpt, print_json
from fedhive.cli.render import job_json, jobs_table, print_job, site_json, sites_table
from fedhive.jobs.limits import MAX_LIST_LIMIT
from fedhive.jobs.status import JobStatus
from fedhive.sdk import Session


def _now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def _session(ctx: typer.Context) -> Iterator[Session]:
    """A session from the global options (then the config file); errors as one line."""
    options: GatewayTarget = ctx.obj or GatewayTarget()
    config_file: Path = ctx.meta.get(CONFIG_FILE_KEY) or CONFIG_FILE
    try:
        session = options.merged(load_config_file(config_file.expanduser())).open()
        with session:
            yield session
    except Exception as err:
        if not mapped(err):  # a bug: its traceback
            raise
        raise fail(err) from None  # exit code: fedhive.cli.exits


def full_id(session: Session, job_id: str) -> str:
    """The job's full id: `job_id` itself when it is one (fedhive's ids are canonical uuids),
    else what the gateway resolves it to (a unique prefix, any case)."""
    try:
        if str(uuid.UUID(job_id)) == job_id:
            return job_id
    except ValueError:
        pass
    return session.get(job_id).job_id


def parse_statuses(values: list[str]) -> list[JobStatus]:
    """FLARE's strings or names, any case; `FINISHED` means every final status."""
    statuses: list[JobStatus] = []
    for value in values:
        wanted = value.strip().upper().replace(":", "_")
        if wanted == "FINISHED":
            statuses += [s for s in JobStatus if s.is_final]
            continue
        match = [s for s in JobStatus if wanted in (s.name, s.value.replace(":", "_"))]
        if not match:
            choices = ", ".join(s.value for s in JobStatus)
            raise typer.BadParameter(f"{value!r} is not a job status ({choices}, FINISHED)",
                                     param_hint="--status")
        statuses += match
    return statuses


def submit(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="A job folder, job zip or single app folder.")],
    submission_id: Annotated[str, typer.Option(
        help="Client-chosen id: resubmitting the same content with it returns the same job. "
        "Default: a new one (a uuid), which the retries after a lost connection reuse."
    )] = "",
    queue_anyway: Annotated[bool, typer.Option(
        help="Queue the job even if no registered site could run it now."
    )] = False,
    as_json: JsonOpt = False,
) -> None:
    """Validate a job locally, upload it and print its id."""
    with _session(ctx) as session:
        result = session.submit(path, submission_id=submission_id, queue_anyway=queue_anyway)
    if as_json:
        print_json({"id": result.job_id, "existed": result.existed,
                     "submission_id": result.submission_id})
    elif result.existed and submission_id:  # without one, only our own retry found it
        typer.echo(f"Already submitted as job: {result.job_id}")
    else:
        typer.echo(f"Submitted job: {result.job_id}")


def jobs(
    ctx: typer.Context,
    status: Annotated[list[str] | None, typer.Option(
        "--status", "-s", help="Only jobs in this status (repeatable; FINISHED: any final)."
    )] = None,
    name: Annotated[str, typer.Option("--name", help="Only jobs whose name contains this.")] = "",
    user: Annotated[str, typer.Option("--user", "-u", help="Only jobs this user submitted.")] = "",
    id_prefix: Annotated[str, typer.Option("--id", help="Only jobs whose id starts so.")] = "",
    limit: Annotated[int, typer.Option(
        "-n", "--limit", min=0, max=MAX_LIST_LIMIT,
        help="At most this many (newest first); 0: the gateway's page.",
    )] = 0,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first."""
    statuses = parse_statuses(status or [])
    with _session(ctx) as session:
        found = session.list(status=statuses, name=name, submitter=user, id_prefix=id_prefix,
                             limit=limit)
    now = _now_ms()
    if as_json:
        print_json([job_json(job, now) for job in found])
    elif not found:
        typer.echo("No jobs found." if not (statuses or name or user or id_prefix)
                   else "No jobs matching the specified criteria.")
    else:
        console = Console()
        console.print(jobs_table(found, now, console.width))


def job(ctx: typer.Context, job_id: JobId, as_json: JsonOpt = False) -> None:
    """Show one job: meta, status, times and status history."""
    with _session(ctx) as session:
        record = session.get(job_id)
    if as_json:
        print_json(job_json(record, _now_ms()))
    else:
        print_job(Console(), record, _now_ms())


def clone(ctx: typer.Context, job_id: JobId, as_json: JsonOpt = False) -> None:
    """Submit a copy of a job (new id, you as its submitter)."""
    with _session(ctx) as session:
        job_id = full_id(session, job_id)
        result = session.clone(job_id)
    if as_json:
        print_json({"id": result.job_id, "cloned_from": job_id})
    else:
        typer.echo(f"Cloned job {job_id} as: {result.job_id}")


def resume(ctx: typer.Context, job_id: JobId, as_json: JsonOpt = False) -> None:
    """Continue an aborted or failed job from its last completed round (a new job)."""
    with _session(ctx) as session:
        job_id = full_id(session, job_id)
        result = session.resume(job_id)
    if as_json:
        print_json({"id": result.job_id, "resumed_from": job_id})
    else:
        typer.echo(f"Resumed job {job_id} as: {result.job_id}")


def delete(ctx: typer.Context, job_id: JobId, as_json: JsonOpt = False) -> None:
    """Delete a finished job (its record and stored files)."""
    with _session(ctx) as session:
        job_id = full_id(session, job_id)
        session.delete(job_id)
    if as_json:
        print_json({"id": job_id, "deleted": True})
    else:
        typer.echo(f"Job {job_id} deleted.")


def abort(
    ctx: typer.Context,
    job_id: JobId,
    reason: Annotated[str, typer.Option(help="Why (kept in the job's history).")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Abort a job."""
    with _session(ctx) as session:
        record = session.abort(job_id, reason)
    if as_json:
        print_json(job_json(record, _now_ms()))
    else:
        typer.echo(f"Job {record.job_id}: {record.status.value} ({record.status_reason})")


def download(
    ctx: typer.Context,
    job_id: JobId,
    out: Annotated[Path, typer.Option("-o", "--output", help="Folder to write into.")] = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Download a job into OUTPUT/<id>/: job.zip, meta.json and, if it has one, result.zip."""
    with _session(ctx) as session:
        record = session.get(job_id)
        job_id = record.job_id  # the full id, when a prefix was given
        folder = out / job_id
        folder.mkdir(parents=True, exist_ok=True)
        files = [_download_to(session, job_id, folder / "job.zip", result=False)]
        if record.result_key:
            files.append(_download_to(session, job_id, folder / "result.zip", result=True))
        meta = folder / "meta.json"
        meta.write_text(json.dumps(job_json(record, _now_ms()), indent=2) + "\n")
        files.append(meta)
    if as_json:
        print_json({"id": job_id, "files": [str(f) for f in files]})
    else:
        for path in files:
            typer.echo(str(path))


def _download_to(session: Session, job_id: str, target: Path, *, result: bool) -> Path:
    """Write through a temporary name so a failed download leaves no partial file."""
    partial = target.with_name(target.name + ".part")
    try:
        with partial.open("wb") as out:
            session.download(job_id, out, result=result)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def sites(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the sites that ever registered, with their liveness."""
    with _session(ctx) as session:
        found = session.sites()
    if as_json:
        print_json([site_json(site) for site in found])
    elif not found:
        typer.echo("No sites registered.")
    else:
        Console().print(sites_table(found))
