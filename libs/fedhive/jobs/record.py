"""The job record: what fedhive knows about one job, as plain dataclasses.

These are the domain objects services pass around; `fedhive.jobs.serde` converts them to and
from the protobuf wire messages, and `fedhive.state` stores them. Times are unix epoch
milliseconds; `None` means "not happened yet" (start/end/schedule times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedhive.jobs.status import JobStatus

DEFAULT_SPEC = "@default"  # resource_spec key: the spec of every site without its own


@dataclass(frozen=True)
class JobMeta:
    """The typed part of meta.json (proto `fedhive.v1.JobMeta`); other keys stay in `extra`."""

    name: str
    resource_spec: dict[str, dict[str, Any]] = field(default_factory=dict)  # site -> resources
    deploy_map: dict[str, list[str]] = field(default_factory=dict)  # app -> targets
    min_clients: int | None = None
    mandatory_clients: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def resource_spec_for(self, site: str) -> dict[str, Any]:
        """What `site` must reserve: its own entry, else `@default`'s (kept only for a job
        deployed to `@ALL`; validation writes it out for named sites), else nothing."""
        return dict(self.resource_spec.get(site, self.resource_spec.get(DEFAULT_SPEC, {})))


@dataclass(frozen=True)
class Submitter:
    name: str
    org: str = ""
    role: str = ""


@dataclass(frozen=True)
class StatusChange:
    """One entry of a job's status history; `from_status` is None for the submission itself."""

    from_status: JobStatus | None
    to_status: JobStatus
    reason: str
    at_ms: int


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    meta: JobMeta
    status: JobStatus
    submitter: Submitter
    submit_time_ms: int
    start_time_ms: int | None = None
    end_time_ms: int | None = None
    schedule_count: int = 0
    last_schedule_time_ms: int | None = None
    next_schedule_time_ms: int | None = None
    sites: list[str] = field(default_factory=list)
    failed_sites: list[str] = field(default_factory=list)
    archive_key: str = ""
    result_key: str = ""
    history: list[StatusChange] = field(default_factory=list)
    pending_reason: dict[str, Any] = field(default_factory=dict)  # empty: not waiting
    # site -> reservation token of its check_resources, set with SUBMITTED -> DISPATCHED
    reservations: dict[str, str] = field(default_factory=dict)
    # site -> its part in the run, written by the job-runner: allocated, deployed, started
    # (bools), excluded and gone (why it was left out / the server job was told it is gone;
    # "" if not), last_heartbeat_ms (its last heartbeat for the job; 0: none seen)
    site_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the job this one continues from its checkpoint (`fedhive resume`); "" if none
    resumed_from: str = ""
    # site ("server": the server job) -> the last error line of its shared log (`fedhive
    # logs`); only GetJob fills it in (the job-store reads it beside the record)
    last_errors: dict[str, str] = field(default_factory=dict)

    @property
    def status_reason(self) -> str:
        """Why the job has its current status: the reason of the last history entry."""
        return self.history[-1].reason if self.history else ""


@dataclass(frozen=True)
class JobStatusEvent:
    """Published on the events exchange as `job.status.<STATUS>` for every status change."""

    job_id: str
    change: StatusChange
