"""What the CLI prints: the stable JSON schema of jobs and sites, and the human tables.

JSON job (`--json`; `jobs --json` prints a list of these):

    id, name, status ("FINISHED:ABORTED", FLARE's strings), status_reason, submitter, org, role,
    submit_time, start_time, end_time (ISO 8601 UTC or null), duration_s (null until started),
    schedule_count, last_schedule_time, next_schedule_time, sites, failed_sites, deploy_map,
    resource_spec, min_clients, mandatory_clients, cloned_from (null if not a clone),
    resumed_from (null unless the job continues another's checkpoint), parent (null unless a
    hub site created the job: the upper tier's {tier, job_id, hub_site}),
    pending_reason ({} unless a SUBMITTED job waits), history [{from, to, reason, at}],
    site_states ({site: {allocated, deployed, started, excluded, gone, last_heartbeat}}: each
    site's part in the run; excluded/gone say why, "" if not; last_heartbeat ISO or null),
    last_errors ({site: line}: the last error line of each site's log, "server" for the
    server job's; {} when none or in `jobs --json`: `fedhive logs`)

JSON site: name, org, online, last_seen (ISO 8601 UTC), running_jobs, resources, agent_version.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from rich.console import Console
from rich.table import Table

from fedhive.jobs.record import JobRecord
from fedhive.jobs.tiers import HIERARCHY, tier_of
from fedhive.sdk import SiteInfo


def iso(ms: int | None) -> str | None:
    """Unix milliseconds as ISO 8601 UTC (`2025-01-31T12:00:00.123Z`); None stays None."""
    if not ms:
        return None
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _duration_s(job: JobRecord, now_ms: int) -> float | None:
    if job.start_time_ms is None:
        return None
    return ((job.end_time_ms or now_ms) - job.start_time_ms) / 1000


def job_json(job: JobRecord, now_ms: int) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "name": job.meta.name,
        "status": job.status.value,
        "status_reason": job.status_reason,
        "submitter": job.submitter.name,
        "org": job.submitter.org,
        "role": job.submitter.role,
        "submit_time": iso(job.submit_time_ms),
        "start_time": iso(job.start_time_ms),
        "end_time": iso(job.end_time_ms),
        "duration_s": _duration_s(job, now_ms),
        "schedule_count": job.schedule_count,
        "last_schedule_time": iso(job.last_schedule_time_ms),
        "next_schedule_time": iso(job.next_schedule_time_ms),
        "sites": job.sites,
        "failed_sites": job.failed_sites,
        "deploy_map": job.meta.deploy_map,
        "resource_spec": job.meta.resource_spec,
        "min_clients": job.meta.min_clients,
        "mandatory_clients": job.meta.mandatory_clients,
        "cloned_from": job.meta.extra.get("cloned_from"),
        "resumed_from": job.resumed_from or None,
        "parent": _parent(job),
        "pending_reason": job.pending_reason,
        "site_states": {site: _site_state(values) for site, values in job.site_states.items()},
        "history": [
            {
                "from": change.from_status.value if change.from_status else None,
                "to": change.to_status.value,
                "reason": change.reason,
                "at": iso(change.at_ms),
            }
            for change in job.history
        ],
        "last_errors": dict(sorted(job.last_errors.items())),
    }


def _site_state(values: dict[str, Any]) -> dict[str, Any]:
    return {"allocated": bool(values.get("allocated")),
            "deployed": bool(values.get("deployed")),
            "started": bool(values.get("started")),
            "excluded": str(values.get("excluded") or ""),
            "gone": str(values.get("gone") or ""),
            "last_heartbeat": iso(int(values.get("last_heartbeat_ms") or 0))}


def site_json(site: SiteInfo) -> dict[str, Any]:
    beat = site.last_heartbeat
    return {
        "name": site.name,
        "org": beat.org,
        "online": site.online,
        "last_seen": iso(beat.sent_at_ms),
        "running_jobs": beat.running_job_ids,
        "resources": beat.resources,
        "agent_version": beat.agent_version,
    }


def metrics_text(values: dict[str, Any]) -> str:
    """Metrics on one line, by name (a Struct on the wire keeps no key order): `accuracy 0.9125
    · loss 0.25` (floats to 4 significant digits)."""
    return " · ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                      for name, value in sorted(values.items()))


def _human_time(ms: int | None) -> str:
    text = iso(ms)
    return "" if text is None else text[:19].replace("T", " ")


def _human_duration(job: JobRecord, now_ms: int) -> str:
    seconds = _duration_s(job, now_ms)
    return "N/A" if seconds is None else str(timedelta(seconds=round(seconds)))


JOB_COLUMNS = ("Job ID", "Name", "Status", "Submitter", "Submit Time (UTC)", "Run Duration")
# Left out, in this order, while the table would not fit the console with its job ids and
# statuses whole on one line and names at least NAME_MIN wide.
OPTIONAL_JOB_COLUMNS = ("Run Duration", "Submitter", "Submit Time (UTC)")
NAME_MIN = 8


def jobs_table(jobs: list[JobRecord], now_ms: int, width: int | None = None) -> Table:
    """The `fedhive jobs` table. Statuses are never cut, wrapped or shortened, nor are job ids
    unless the console cannot hold them and the statuses side by side; names and the other
    cells fold onto more lines when narrow. With the console's `width`, the optional columns
    that would not fit are left out (the caption says which)."""
    rows = [(job.job_id, job.meta.name, job.status.value, job.submitter.name,
             _human_time(job.submit_time_ms), _human_duration(job, now_ms)) for job in jobs]
    shown = list(JOB_COLUMNS)
    for optional in OPTIONAL_JOB_COLUMNS:
        if width is None or _table_width(shown, rows) <= width:
            break
        shown.remove(optional)
    hidden = [name for name in JOB_COLUMNS if name not in shown]
    caption = f"not shown (narrow console): {', '.join(hidden)}" if hidden else None
    whole = ["Status"]  # too narrow even then: ids fold, statuses still never do
    if width is None or _table_width(shown, rows) <= width:
        whole.append("Job ID")
    table = Table(*shown, caption=caption)
    for column in table.columns:
        column.overflow = "fold"  # never "…": a long cell goes on over more lines
        column.no_wrap = column.header in whole
    for row in rows:
        table.add_row(*(cell for name, cell in zip(JOB_COLUMNS, row, strict=True)
                        if name in shown))
    return table


def _table_width(shown: list[str], rows: Sequence[tuple[str, ...]]) -> int:
    """The width a table of the `shown` columns needs: each column as wide as its widest cell
    (or header word), names at most NAME_MIN, plus padding and borders (3 per column, 1)."""
    total = 1
    for index, name in enumerate(JOB_COLUMNS):
        if name not in shown:
            continue
        widest = max([len(row[index]) for row in rows] + [len(w) for w in name.split()])
        total += 3 + (min(widest, NAME_MIN) if name == "Name" else widest)
    return total


def _parent(job: JobRecord) -> dict[str, Any] | None:
    """The upper-tier job a hub site made this one for (`fedhive.jobs.tiers`)."""
    entry = job.meta.extra.get(HIERARCHY)
    if not isinstance(entry, dict):
        return None
    return {"tier": tier_of(job.meta) - 1, "job_id": entry.get("parent_job_id"),
            "hub_site": entry.get("hub_site")}


def print_job(console: Console, job: JobRecord, now_ms: int) -> None:
    details = Table(show_header=False, box=None)
    values = job_json(job, now_ms)
    for key in ("id", "name", "status", "status_reason", "submitter", "org", "role",
                "submit_time", "start_time", "end_time", "schedule_count", "sites",
                "failed_sites", "cloned_from", "resumed_from"):
        value = values[key]
        if isinstance(value, list):
            value = ", ".join(value)
        details.add_row(key, "" if value is None else str(value))
    details.add_row("duration", _human_duration(job, now_ms))
    if (parent := values["parent"]) is not None:
        details.add_row("parent", f"tier {parent['tier']} job {parent['job_id']} "
                                  f"(through hub site {parent['hub_site']})")
    if job.pending_reason:
        details.add_row("waiting", str(job.pending_reason.get("summary", job.pending_reason)))
    deploy_map = job.meta.deploy_map.items()
    details.add_row("deploy_map", "; ".join(
        f"{app} -> {' '.join(targets) or '(nowhere)'}" for app, targets in deploy_map
    ))
    console.print(details)
    if job.site_states:
        console.print(_site_states_table(values["site_states"]))
    if job.last_errors:
        errors = Table("Site", "Last Error", title="last errors (fedhive logs)")
        for site, line in sorted(job.last_errors.items()):
            errors.add_row(site, line)
        console.print(errors)
    history = Table("At (UTC)", "From", "To", "Reason", title="history")
    for change in job.history:
        history.add_row(_human_time(change.at_ms),
                        change.from_status.value if change.from_status else "",
                        change.to_status.value, change.reason)
    console.print(history)


def _site_states_table(states: dict[str, dict[str, Any]]) -> Table:
    table = Table("Site", "Allocated", "Deployed", "Started", "Last Heartbeat (UTC)",
                  "Excluded / Gone", title="sites")
    for site, state in sorted(states.items()):
        heartbeat = state["last_heartbeat"]
        why = "; ".join(filter(None, (state["excluded"] and f"excluded: {state['excluded']}",
                                      state["gone"] and f"gone: {state['gone']}")))
        table.add_row(site, *("yes" if state[k] else "no"
                              for k in ("allocated", "deployed", "started")),
                      "" if heartbeat is None else heartbeat[:19].replace("T", " "), why)
    return table


def sites_table(sites: list[SiteInfo]) -> Table:
    table = Table("Site", "Org", "Online", "Last Seen (UTC)", "Running Jobs")
    for site in sites:
        beat = site.last_heartbeat
        table.add_row(site.name, beat.org, "yes" if site.online else "no",
                      _human_time(beat.sent_at_ms), str(len(beat.running_job_ids)))
    return table
