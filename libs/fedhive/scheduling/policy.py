"""DefaultJobScheduler parameters, retry timing and deploy-map resolution (pure functions).

Retry timing follows FLARE's DefaultJobScheduler: after a job's n-th failed try (n >= 1) its next
try is `min(max_schedule_interval, 2**(n-1) * min_schedule_interval)` later, so with the defaults
tries happen at about 0, 10, 30, 70, ... s. Unlike FLARE, the job becomes CAN_NOT_SCHEDULE in the
same pass as its `max_schedule_count`-th failure (FLARE does it on the next 1-s tick), and a job
that waits only for offline sites is tried again as soon as one of them is online (`is_due`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.jobs.record import JobMeta, JobRecord

SERVER = "server"
ALL_SITES = "@ALL"


@dataclass(frozen=True)
class SchedulerConfig:
    max_jobs: int = 1  # jobs DISPATCHED or RUNNING at once
    max_schedule_count: int = 10  # failed tries before FINISHED:CAN_NOT_SCHEDULE
    min_schedule_interval_s: float = 10.0
    max_schedule_interval_s: float = 600.0
    check_timeout_s: float = 15.0  # a site that does not answer check_resources in time: no

    def __post_init__(self) -> None:
        for name in ("max_jobs", "max_schedule_count"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1", field=name)
        for name in ("min_schedule_interval_s", "max_schedule_interval_s", "check_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive", field=name)
        if self.max_schedule_interval_s < self.min_schedule_interval_s:
            raise InvalidArgument(
                "max_schedule_interval_s must be at least min_schedule_interval_s",
                field="max_schedule_interval_s",
            )


def retry_interval_ms(config: SchedulerConfig, failures: int) -> int:
    """How long after its `failures`-th failed try (>= 1) a job is tried again."""
    exponent = max(failures - 1, 0)
    seconds = min(config.max_schedule_interval_s, config.min_schedule_interval_s * (1 << exponent))
    return round(seconds * 1000)


def is_due(record: JobRecord, now_ms: int, online: Collection[str]) -> bool:
    """Whether a SUBMITTED job may be tried in this pass: never tried, its next schedule time
    has come, or it waited for offline sites and one of them is online now."""
    if record.next_schedule_time_ms is None or now_ms >= record.next_schedule_time_ms:
        return True
    awaited = record.pending_reason.get("offline_sites") or []
    return any(site in online for site in awaited)


@dataclass(frozen=True)
class Placement:
    """Where a job would run given the sites online now."""

    sites: list[str]  # client sites to ask, in order
    required: list[str]  # mandatory clients
    min_sites: int  # how many of `sites` must say yes
    offline: list[str] = field(default_factory=list)  # named sites (or mandatory ones) offline

    @property
    def blocker(self) -> str | None:
        """Why the job cannot run without asking anyone, or None."""
        missing = [site for site in self.required if site in self.offline]
        if missing:
            return f"mandatory site{'s' if len(missing) > 1 else ''} offline: {', '.join(missing)}"
        if len(self.sites) < self.min_sites:
            return f"online sites ({len(self.sites)}) < min_clients ({self.min_sites})"
        return None


def resolve_placement(meta: JobMeta, online: Collection[str]) -> Placement:
    """Resolve the deploy map against the online sites.

    `@ALL` means the client sites online now; named sites that are offline are left out (and
    listed). `min_clients` defaults to every named client site; for `@ALL` jobs to 1, as in
    FLARE (`job_from_meta`): "every site that is there" should not stall because one site is
    busy. Mandatory clients must be online and must say yes.
    """
    targets = [t for sites in meta.deploy_map.values() for t in sites if t != SERVER]
    to_all = ALL_SITES in targets
    named = list(dict.fromkeys(t for t in targets if t != ALL_SITES))
    required = list(dict.fromkeys(meta.mandatory_clients))
    wanted = sorted(set(online)) if to_all else named
    for site in required:
        if site not in wanted:
            wanted.append(site)
    offline = [site for site in wanted if site not in online]
    sites = [site for site in wanted if site in online]
    default = 1 if to_all else len(named)
    min_sites = default if meta.min_clients is None else meta.min_clients
    return Placement(sites=sites, required=required, min_sites=max(min_sites, 1), offline=offline)


def requirement_for(meta: JobMeta, site: str) -> dict[str, Any]:
    """The site's resource requirement: its `resource_spec` entry, else `@default`'s, else `{}`."""
    return meta.resource_spec_for(site)
