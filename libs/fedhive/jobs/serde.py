"""Job records to and from the wire (`fedhive.v1.job_pb2`) and to and from JSON-able dicts.

Dict-valued fields travel as `Struct` through `fedhive.structs` (whole numbers stay ints;
integers beyond 2**53 do not survive a Struct). Unset times are `0` on the wire and `None` in
the dataclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedhive.errors import MalformedMessage
from fedhive.jobs.record import JobMeta, JobRecord, JobStatusEvent, StatusChange, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import job_pb2
from fedhive.structs import dict_to_struct, struct_to_dict

_PROTO_PREFIX = "JOB_STATUS_"
# Derived from the two enums' member names, so adding a status to one without the other fails
# at import rather than silently mapping to UNSPECIFIED.
_TO_PROTO: dict[JobStatus, job_pb2.JobStatus.ValueType] = {
    status: job_pb2.JobStatus.Value(_PROTO_PREFIX + status.name) for status in JobStatus
}
_FROM_PROTO: dict[int, JobStatus] = {number: status for status, number in _TO_PROTO.items()}


def status_to_proto(status: JobStatus | None) -> job_pb2.JobStatus.ValueType:
    return job_pb2.JOB_STATUS_UNSPECIFIED if status is None else _TO_PROTO[status]


def status_from_proto(value: int) -> JobStatus | None:
    """UNSPECIFIED (0) is `None`; an unknown number is a malformed message."""
    if value == job_pb2.JOB_STATUS_UNSPECIFIED:
        return None
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise MalformedMessage(f"unknown job status number {value}", field="status") from None


def _required_status(value: int, field: str) -> JobStatus:
    status = status_from_proto(value)
    if status is None:
        raise MalformedMessage(f"{field} is JOB_STATUS_UNSPECIFIED", field=field)
    return status


# Struct <-> plain values --------------------------------------------------------------------
def _ms(value: int | None) -> int:
    return 0 if value is None else value


def _optional_ms(value: int) -> int | None:
    return None if value == 0 else value


# JobMeta ------------------------------------------------------------------------------------
def meta_to_proto(meta: JobMeta) -> job_pb2.JobMeta:
    message = job_pb2.JobMeta(name=meta.name, mandatory_clients=meta.mandatory_clients)
    for site, spec in meta.resource_spec.items():
        message.resource_spec[site].CopyFrom(dict_to_struct(spec))
    for app, targets in meta.deploy_map.items():
        message.deploy_map[app].sites.extend(targets)
    if meta.min_clients is not None:
        message.min_clients = meta.min_clients
    if meta.extra:
        message.extra.CopyFrom(dict_to_struct(meta.extra))
    return message


def meta_from_proto(message: job_pb2.JobMeta) -> JobMeta:
    return JobMeta(
        name=message.name,
        resource_spec={site: struct_to_dict(s) for site, s in message.resource_spec.items()},
        deploy_map={app: list(targets.sites) for app, targets in message.deploy_map.items()},
        min_clients=message.min_clients if message.HasField("min_clients") else None,
        mandatory_clients=list(message.mandatory_clients),
        extra=struct_to_dict(message.extra) if message.HasField("extra") else {},
    )


def meta_to_dict(meta: JobMeta) -> dict[str, Any]:
    """The JSON form kept in the Redis job record (numbers keep their int/float type)."""
    return {
        "name": meta.name,
        "resource_spec": meta.resource_spec,
        "deploy_map": meta.deploy_map,
        "min_clients": meta.min_clients,
        "mandatory_clients": meta.mandatory_clients,
        "extra": meta.extra,
    }


def meta_from_dict(values: Mapping[str, Any]) -> JobMeta:
    return JobMeta(
        name=values["name"],
        resource_spec=dict(values.get("resource_spec") or {}),
        deploy_map={app: list(t) for app, t in (values.get("deploy_map") or {}).items()},
        min_clients=values.get("min_clients"),
        mandatory_clients=list(values.get("mandatory_clients") or []),
        extra=dict(values.get("extra") or {}),
    )


# Records, history, events -------------------------------------------------------------------
def submitter_to_proto(submitter: Submitter) -> job_pb2.Submitter:
    return job_pb2.Submitter(name=submitter.name, org=submitter.org, role=submitter.role)


def submitter_from_proto(message: job_pb2.Submitter) -> Submitter:
    return Submitter(name=message.name, org=message.org, role=message.role)


def change_to_proto(change: StatusChange) -> job_pb2.StatusChange:
    return job_pb2.StatusChange(
        from_status=status_to_proto(change.from_status),
        to_status=status_to_proto(change.to_status),
        reason=change.reason,
        at_ms=change.at_ms,
    )


def change_from_proto(message: job_pb2.StatusChange) -> StatusChange:
    return StatusChange(
        from_status=status_from_proto(message.from_status),
        to_status=_required_status(message.to_status, "to_status"),
        reason=message.reason,
        at_ms=message.at_ms,
    )


def record_to_proto(record: JobRecord) -> job_pb2.JobRecord:
    message = job_pb2.JobRecord(
        job_id=record.job_id,
        meta=meta_to_proto(record.meta),
        status=status_to_proto(record.status),
        submitter=submitter_to_proto(record.submitter),
        submit_time_ms=record.submit_time_ms,
        start_time_ms=_ms(record.start_time_ms),
        end_time_ms=_ms(record.end_time_ms),
        schedule_count=record.schedule_count,
        last_schedule_time_ms=_ms(record.last_schedule_time_ms),
        next_schedule_time_ms=_ms(record.next_schedule_time_ms),
        sites=record.sites,
        failed_sites=record.failed_sites,
        archive_key=record.archive_key,
        result_key=record.result_key,
        history=[change_to_proto(change) for change in record.history],
        reservations=record.reservations,
        resumed_from=record.resumed_from,
        last_errors=record.last_errors,
    )
    if record.pending_reason:
        message.pending_reason.CopyFrom(dict_to_struct(record.pending_reason))
    if record.site_states:
        message.site_states.CopyFrom(dict_to_struct(record.site_states))
    return message


def record_from_proto(message: job_pb2.JobRecord) -> JobRecord:
    return JobRecord(
        job_id=message.job_id,
        meta=meta_from_proto(message.meta),
        status=_required_status(message.status, "status"),
        submitter=submitter_from_proto(message.submitter),
        submit_time_ms=message.submit_time_ms,
        start_time_ms=_optional_ms(message.start_time_ms),
        end_time_ms=_optional_ms(message.end_time_ms),
        schedule_count=message.schedule_count,
        last_schedule_time_ms=_optional_ms(message.last_schedule_time_ms),
        next_schedule_time_ms=_optional_ms(message.next_schedule_time_ms),
        sites=list(message.sites),
        failed_sites=list(message.failed_sites),
        archive_key=message.archive_key,
        result_key=message.result_key,
        history=[change_from_proto(change) for change in message.history],
        pending_reason=(
            struct_to_dict(message.pending_reason) if message.HasField("pending_reason") else {}
        ),
        reservations=dict(message.reservations),
        site_states=(
            struct_to_dict(message.site_states) if message.HasField("site_states") else {}
        ),
        resumed_from=message.resumed_from,
        last_errors=dict(message.last_errors),
    )


def event_to_proto(event: JobStatusEvent) -> job_pb2.JobStatusEvent:
    return job_pb2.JobStatusEvent(job_id=event.job_id, change=change_to_proto(event.change))


def event_from_proto(message: job_pb2.JobStatusEvent) -> JobStatusEvent:
    return JobStatusEvent(job_id=message.job_id, change=change_from_proto(message.change))
