"""`fedhive logs JOB [--site NAME] [--follow] [--json]`: a job's log lines.

The server job's lines (site `server`, source `server`) and each site's client job and trainer
lines (source `client_job`: their stdout and stderr), oldest first, while the job runs and
after it ends (`Session.logs`; the sites share them through the job-runner, `fedhive.joblogs`).

* Plain: `SITE SOURCE | LINE` per line.
* `--json`: one JSON object per line: {"id", "site", "source", "line"} (`id` orders the lines).
* `--site NAME`: that site's lines only (`server`: the server job's).
* `--follow`: go on printing new lines until the job is final and every site that ran it sent
  its last line (as `watch` follows a job).

A site whose config says `share_logs: false` shares nothing; a line on stderr says so. Exit
codes (`fedhive.cli.exits`): 0 ok, 3 unknown job, 4 denied, 5 gateway unreachable, 130 after
Ctrl-C.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from fedhive.cli.exits import Exit
from fedhive.cli.jobs import _session
from fedhive.cli.options import JobId, JsonOpt
from fedhive.joblogs.wire import LogEntry


def plain(entry: LogEntry) -> str:
    return f"{entry.site} {entry.source} | {entry.line}"


def as_json_line(entry: LogEntry) -> str:
    return json.dumps({"id": entry.id, "site": entry.site, "source": entry.source,
                       "line": entry.line})


def private_note(site: str) -> str:
    return (f"note: site {site} does not share its logs (share_logs is false in its site "
            "config)")


def logs(
    ctx: typer.Context,
    job_id: JobId,
    site: Annotated[str, typer.Option(
        "--site", help="Only this site's lines (server: the server job's).")] = "",
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show a job's log lines: the server job's and each site's client job and trainer."""
    show = as_json_line if as_json else plain
    told: set[str] = set()

    def tell(private: list[str]) -> None:
        for name in private:
            if name not in told and (not site or site == name):
                told.add(name)
                typer.echo(private_note(name), err=True)

    try:
        with _session(ctx) as session:
            stream = session.logs(job_id, site or None, follow)
            for entry in stream:
                tell(stream.private_sites)
                typer.echo(show(entry))
            tell(stream.private_sites)
    except KeyboardInterrupt:
        raise typer.Exit(Exit.INTERRUPTED) from None
