"""The state port: what services may ask of the state store (jobs, leases, sites, idempotency).

Small protocols so a handler depends only on what it uses; `RedisStateStore` implements all of
them and `MemoryStateStore` is the in-process double; both pass the one contract suite
(tests/integration/test_state_{jobs,leases,sites}.py, fixture `state_store`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat


@dataclass(frozen=True)
class JobUpdate:
    """Non-status fields to set on a job record; `None` leaves a field as it is.

    `pending_reason={}` clears the pending reason.
    """

    schedule_count: int | None = None
    last_schedule_time_ms: int | None = None
    next_schedule_time_ms: int | None = None
    pending_reason: dict[str, Any] | None = None
    sites: list[str] | None = None
    failed_sites: list[str] | None = None
    archive_key: str | None = None
    result_key: str | None = None
    reservations: dict[str, str] | None = None
    site_states: dict[str, dict[str, Any]] | None = None


@dataclass(frozen=True)
class Fence:
    """Makes a write conditional: it happens only if `token` is lease `lease`'s current token."""

    lease: str
    token: int


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    token: int
    expires_in_s: float


class JobStore(Protocol):
    def create_job(
        self,
        job_id: str,
        meta: JobMeta,
        submitter: Submitter,
        *,
        archive_key: str = "",
        reason: str = "submitted",
        resumed_from: str = "",
    ) -> JobRecord:
        """Store a new job in status SUBMITTED; AlreadyExists if the id is taken.
        `resumed_from`: the job whose checkpoint the new one continues from."""
        ...

    def get_job(self, job_id: str) -> JobRecord:
        """The record with its history; NotFound naming the id."""
        ...

    def list_jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        """Jobs (all, or those in `status`) in submission order."""
        ...

    def recent_job_ids(
        self, status: JobStatus | None = None, *, start: int = 0, count: int = 100
    ) -> list[str]:
        """Ids of jobs (all, or those in `status`), newest submission first: up to `count` of
        them from position `start` (0: the newest). Pages through large stores cheaply."""
        ...

    def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The records (with history) of those of `job_ids` that exist, in the given order,
        read in one round trip; ids with no record are skipped."""
        ...

    def find_job_ids(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of jobs that start with `prefix`, compared case-insensitively, sorted: at most
        `limit` of them (the search stops there; which ones, when more match, is not
        specified). Reads the job-id index only, never a record; "" matches every job."""
        ...

    def change_status(
        self,
        job_id: str,
        expected: JobStatus,
        new: JobStatus,
        reason: str,
        *,
        update: JobUpdate | None = None,
        fence: Fence | None = None,
    ) -> JobRecord:
        """The one way to change a status: atomic compare-and-set enforcing `TRANSITIONS`.

        IllegalTransition when the job is not in `expected` or `expected -> new` is not allowed;
        StaleFencingToken when `fence` is not current; NotFound for an unknown job. On any error
        the record is unchanged.
        """
        ...

    def update_job(
        self,
        job_id: str,
        update: JobUpdate,
        *,
        fence: Fence | None = None,
        expected: JobStatus | None = None,
    ) -> JobRecord:
        """Set non-status fields atomically (NotFound, StaleFencingToken as above); with
        `expected`, only while the job is in that status (else IllegalTransition)."""
        ...

    def delete_job(self, job_id: str) -> bool:
        """Remove the record, its history, its round log (`fedhive.state.rounds`) and index
        entries; False if there was none."""
        ...


class Leases(Protocol):
    def acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        """A fencing token (higher than any before for `name`), or None if another holds it.

        Acquiring again as the current holder extends the lease and returns the same token.
        """
        ...

    def renew(self, name: str, holder: str, token: int, ttl_s: float) -> None:
        """Extend the lease; LeaseNotHeld if `token` is no longer the lease's current token."""
        ...

    def take_over(self, name: str, holder: str, ttl_s: float, *, previous: str) -> int | None:
        """A new fencing token (higher than any before) for `holder` when the lease is free or
        held by `previous` or `holder`: whoever held it until now is fenced out (renewing or
        fencing with the old token fails). None (nothing changes) when another holder has it.
        For a successor that knows its predecessor is gone, e.g. a restarted process."""
        ...

    def release(self, name: str, holder: str, token: int) -> bool:
        """Give the lease up; False (and nothing changes) if not held with this token."""
        ...

    def get_lease(self, name: str) -> Lease | None: ...


class SiteRegistry(Protocol):
    def record_heartbeat(self, beat: SiteHeartbeat, ttl_s: float) -> None:
        """Keep `beat` as the site's last heartbeat for `ttl_s`; the site stays known forever."""
        ...

    def get_site(self, site: str) -> SiteHeartbeat | None:
        """The last heartbeat of a live site; None once its TTL expired."""
        ...

    def live_sites(self) -> list[SiteHeartbeat]:
        """Heartbeats of sites whose TTL has not expired, by site name."""
        ...

    def known_sites(self) -> list[str]:
        """Every site that ever sent a heartbeat, by name."""
        ...


class SitePresence(Protocol):
    """Registry transitions for the heartbeat intake: batched writes, and online/offline changes
    that exactly one caller observes, so several intake replicas (or a restarted one) never
    announce a transition twice. The online set lives in the store, not in the intake."""

    def record_heartbeats(self, beats: Sequence[SiteHeartbeat], ttl_s: float) -> list[str]:
        """Store each beat as its site's live record for `ttl_s` (and as its last known beat);
        a beat older than the site's last recorded one (`sent_at_ms`) is ignored. Returns the
        sites this call took from offline to online, each once across all callers."""
        ...

    def mark_offline(self, beat: SiteHeartbeat) -> bool:
        """A site's goodbye: its live record goes (it stays known, `beat` is its last one).
        True for the one caller that took it from online to offline; False when it was not
        online or `beat` is older than its last recorded beat (then nothing changes)."""
        ...

    def sweep_expired(self) -> list[SiteHeartbeat]:
        """Sites marked online whose live record has expired: each is marked offline and
        returned, with its last known heartbeat, to exactly one caller."""
        ...

    def last_heartbeats(self) -> dict[str, SiteHeartbeat]:
        """Every site's last recorded heartbeat (live or not), by site name: what a site last
        reported about itself, e.g. its resources' totals, after it went offline too."""
        ...

    def online_sites(self) -> list[str]:
        """Sites currently marked online (announced and not yet swept or gone), by name."""
        ...

    def record_job_heartbeats(self, beats: Sequence[JobHeartbeat], ttl_s: float) -> None:
        """Keep each beat as the last one of its (job, site) for `ttl_s`; a beat that is not
        `ended` never replaces an ended one (a client job's end is its last word, whichever
        arrives first)."""
        ...

    def get_job_heartbeat(self, job_id: str, site: str) -> JobHeartbeat | None:
        """The last beat of a client job, None once its TTL expired."""
        ...

    def get_job_heartbeats(self, job_id: str, sites: Sequence[str]) -> dict[str, JobHeartbeat]:
        """The last beats of the job's client jobs at `sites`, in one read (a runner judges a
        job's sites every tick); a site whose beat expired is absent."""
        ...


class Idempotency(Protocol):
    def claim(self, scope: str, message_id: str, ttl_s: float) -> bool:
        """True the first time (scope, message_id) is claimed within `ttl_s`, False after."""
        ...

    def remember(self, scope: str, key: str, value: str, ttl_s: float) -> str:
        """Keep `value` under (scope, key) for `ttl_s` unless a value is already kept there;
        return the kept value. The first caller wins: concurrent callers all get its value."""
        ...


class StateStore(JobStore, Leases, SiteRegistry, SitePresence, Idempotency, Protocol):
    def close(self) -> None: ...
