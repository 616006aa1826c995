"""Why a SUBMITTED job waits: the structured `pending_reason` the scheduler keeps on it.

Keys (all JSON): `position` (1 = next in line), `waiting_for` (`max_jobs`, `sites_offline`,
`resources`, `next_try`), `max_jobs` and `active_jobs` (when the slots are full),
`offline_sites` (named or mandatory sites offline at the last look), `refusals` (site -> what it
lacked, from its check_resources reply), `last_try` (the last failed try's one-line reason),
`schedule_count`, `next_try_ms` (epoch ms; null: at the next pass) and `summary` (one line for
people; `fedhive job ID` prints it). Only what changes a decision is in it, so a pass rewrites
a job's reason only when something about its wait changed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fedhive.jobs.record import JobRecord

CARRIED = ("offline_sites", "refusals", "last_try", "next_try_ms")  # kept until the next try


def _at(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def summary(reason: dict[str, Any], max_schedule_count: int) -> str:
    parts = [f"#{reason['position']} in queue"]
    if reason["waiting_for"] == "max_jobs":
        parts.append(f"max_jobs {reason['max_jobs']} reached ({reason['active_jobs']} "
                     "dispatched or running)")
    if reason.get("offline_sites"):
        parts.append(f"offline: {', '.join(reason['offline_sites'])}")
    if reason.get("refusals"):
        parts.append("said no: " + "; ".join(f"{s}: {r}" for s, r in reason["refusals"].items()))
    elif reason.get("last_try"):
        parts.append(f"last try: {reason['last_try']}")
    if reason.get("next_try_ms") is not None:
        parts.append(f"next try {_at(reason['next_try_ms'])} "
                     f"(failed {reason['schedule_count']} of {max_schedule_count})")
    return "; ".join(parts)


def _reason(
    position: int, waiting_for: str, count: int, max_schedule_count: int, **details: Any
) -> dict[str, Any]:
    reason: dict[str, Any] = {"position": position, "waiting_for": waiting_for,
                              "schedule_count": count}
    reason.update({key: value for key, value in details.items() if value not in (None, [], {})})
    reason["summary"] = summary(reason, max_schedule_count)
    return reason


def carried(record: JobRecord) -> dict[str, Any]:
    """The details of the job's last failed try, kept while it waits for the next one."""
    return {key: record.pending_reason[key] for key in CARRIED if key in record.pending_reason}


def slots_full(record: JobRecord, position: int, active: int, max_jobs: int,
               max_schedule_count: int) -> dict[str, Any]:
    return _reason(position, "max_jobs", record.schedule_count, max_schedule_count,
                   max_jobs=max_jobs, active_jobs=active, **carried(record))


def not_due(record: JobRecord, position: int, max_schedule_count: int) -> dict[str, Any]:
    """Tried and failed; waits for its next schedule time."""
    previous = record.pending_reason.get("waiting_for", "next_try")
    waiting_for = "next_try" if previous == "max_jobs" else previous
    return _reason(position, waiting_for, record.schedule_count, max_schedule_count,
                   **carried(record))


def failed_try(position: int, count: int, max_schedule_count: int, *, offline: list[str],
               refusals: dict[str, str], last_try: str, next_try_ms: int) -> dict[str, Any]:
    waiting_for = "sites_offline" if offline and not refusals else "resources"
    return _reason(position, waiting_for, count, max_schedule_count, offline_sites=offline,
                   refusals=refusals, last_try=last_try, next_try_ms=next_try_ms)
