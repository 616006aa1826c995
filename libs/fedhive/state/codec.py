"""How a job record lies in Redis.

`{ns}:job:<id>` is a hash of strings, one field per record attribute: scalars as text, `meta`
as the JSON of `fedhive.jobs.serde.meta_to_dict` (JSON rather than protobuf bytes so the
record reads in redis-cli and keeps int/float apart), `sites`, `failed_sites`,
`pending_reason`, `reservations` and `site_states` as JSON, times as epoch-millisecond
integers (absent: not happened yet).
`{ns}:job:<id>:history` is a list of JSON objects `{"from", "to", "reason", "at"}`, oldest
first; the status reason is the reason of the last entry.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fedhive.errors import FedhiveError
from fedhive.jobs.record import JobMeta, JobRecord, StatusChange, Submitter
from fedhive.jobs.serde import meta_from_dict, meta_to_dict
from fedhive.jobs.status import JobStatus
from fedhive.state.port import JobUpdate


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def create_fields(
    meta: JobMeta, submitter: Submitter, archive_key: str, resumed_from: str = ""
) -> list[str]:
    """Field/value pairs, flattened, set when a job is created (besides id, status, times)."""
    return [
        "meta", _json(meta_to_dict(meta)),
        "submitter_name", submitter.name,
        "submitter_org", submitter.org,
        "submitter_role", submitter.role,
        "archive_key", archive_key,
        "sites", "[]",
        "failed_sites", "[]",
        "pending_reason", "{}",
        "reservations", "{}",
        "resumed_from", resumed_from,
    ]  # fmt: skip


def update_fields(update: JobUpdate | None) -> list[str]:
    """Field/value pairs, flattened, for the fields `update` sets."""
    if update is None:
        return []
    values: dict[str, str | None] = {
        "schedule_count": _text(update.schedule_count),
        "last_schedule_time_ms": _text(update.last_schedule_time_ms),
        "next_schedule_time_ms": _text(update.next_schedule_time_ms),
        "pending_reason": None if update.pending_reason is None else _json(update.pending_reason),
        "sites": None if update.sites is None else _json(update.sites),
        "failed_sites": None if update.failed_sites is None else _json(update.failed_sites),
        "archive_key": update.archive_key,
        "result_key": update.result_key,
        "reservations": None if update.reservations is None else _json(update.reservations),
        "site_states": None if update.site_states is None else _json(update.site_states),
    }
    return [item for name, value in values.items() if value is not None for item in (name, value)]


def _text(value: int | None) -> str | None:
    return None if value is None else str(value)


def _time(fields: dict[str, str], name: str) -> int | None:
    value = fields.get(name, "")
    return int(value) if value else None


def _change(entry: str) -> StatusChange:
    values = json.loads(entry)
    return StatusChange(
        from_status=JobStatus(values["from"]) if values["from"] else None,
        to_status=JobStatus(values["to"]),
        reason=values["reason"],
        at_ms=int(values["at"]),
    )


def pairs_to_dict(flat: Sequence[str]) -> dict[str, str]:
    """HGETALL as a Lua script answers it (a flat list) into a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def record_from_redis(key: str, fields: dict[str, str], history: Sequence[str]) -> JobRecord:
    try:
        return JobRecord(
            job_id=fields["job_id"],
            meta=meta_from_dict(json.loads(fields["meta"])),
            status=JobStatus(fields["status"]),
            submitter=Submitter(
                name=fields.get("submitter_name", ""),
                org=fields.get("submitter_org", ""),
                role=fields.get("submitter_role", ""),
            ),
            submit_time_ms=int(fields["submit_time_ms"]),
            start_time_ms=_time(fields, "start_time_ms"),
            end_time_ms=_time(fields, "end_time_ms"),
            schedule_count=int(fields.get("schedule_count") or 0),
            last_schedule_time_ms=_time(fields, "last_schedule_time_ms"),
            next_schedule_time_ms=_time(fields, "next_schedule_time_ms"),
            sites=json.loads(fields.get("sites") or "[]"),
            failed_sites=json.loads(fields.get("failed_sites") or "[]"),
            archive_key=fields.get("archive_key", ""),
            result_key=fields.get("result_key", ""),
            history=[_change(entry) for entry in history],
            pending_reason=json.loads(fields.get("pending_reason") or "{}"),
            reservations=json.loads(fields.get("reservations") or "{}"),
            site_states=json.loads(fields.get("site_states") or "{}"),
            resumed_from=fields.get("resumed_from", ""),
        )
    except (KeyError, ValueError) as err:
        raise FedhiveError(f"job record {key} is corrupt: {err!r}", field=key) from err
