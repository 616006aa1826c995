"""An in-process state store for fast unit tests of code that uses the state port.

It passes the same contract suite as `RedisStateStore`: one lock makes every operation atomic,
status changes obey `fedhive.jobs.status.TRANSITIONS` (through `is_allowed`), and TTLs run on
the monotonic clock. It shares nothing between processes, so it is never used by a service;
`fedhive simulate` keeps its job record in one.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fedhive.errors import (
    AlreadyExists,
    IllegalTransition,
    LeaseNotHeld,
    NotFound,
    StaleFencingToken,
)
from fedhive.jobs.record import JobMeta, JobRecord, StatusChange, Submitter
from fedhive.jobs.status import INITIAL, JobStatus, is_allowed
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.state.port import Fence, JobUpdate, Lease


@dataclass
class _Expiring:
    value: Any
    expires_at: float  # time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() < self.expires_at


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class MemoryStateStore:
    """Implements `fedhive.state.port.StateStore` in memory, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}  # insertion order is submission order
        self._leases: dict[str, _Expiring] = {}  # value: (holder, token)
        self._fences: dict[str, int] = {}
        self._sites: dict[str, _Expiring] = {}  # value: SiteHeartbeat
        self._seen_ms: dict[str, int] = {}  # site -> last recorded sent_at_ms
        self._last: dict[str, SiteHeartbeat] = {}  # site -> last beat, kept past its TTL
        self._online: set[str] = set()
        self._job_beats: dict[tuple[str, str], _Expiring] = {}  # value: JobHeartbeat
        self._claims: dict[tuple[str, str], _Expiring] = {}  # value: the kept string

    def close(self) -> None:
        """Nothing to release; here to satisfy the port."""

    # jobs -----------------------------------------------------------------------------------
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
        with self._lock:
            if job_id in self._jobs:
                raise AlreadyExists(f"job {job_id} already exists", field="job_id")
            now = _now_ms()
            record = JobRecord(
                job_id=job_id,
                meta=copy.deepcopy(meta),
                status=INITIAL,
                submitter=submitter,
                submit_time_ms=now,
                archive_key=archive_key,
                resumed_from=resumed_from,
                history=[StatusChange(None, INITIAL, reason, now)],
            )
            self._jobs[job_id] = record
            return copy.deepcopy(record)

    def _job(self, job_id: str) -> JobRecord:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFound(f"job {job_id} not found", field="job_id") from None

    def get_job(self, job_id: str) -> JobRecord:
        with self._lock:
            return copy.deepcopy(self._job(job_id))

    def list_jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        with self._lock:
            return [
                copy.deepcopy(record)
                for record in self._jobs.values()
                if status is None or record.status == status
            ]

    def recent_job_ids(
        self, status: JobStatus | None = None, *, start: int = 0, count: int = 100
    ) -> list[str]:
        with self._lock:
            ids = [
                job_id
                for job_id, record in reversed(self._jobs.items())
                if status is None or record.status == status
            ]
        return ids[start : start + count] if count > 0 else []

    def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        with self._lock:
            return [copy.deepcopy(self._jobs[i]) for i in job_ids if i in self._jobs]

    def find_job_ids(self, prefix: str, *, limit: int) -> list[str]:
        wanted = prefix.lower()
        with self._lock:
            found = [i for i in self._jobs if i.lower().startswith(wanted)]
        return sorted(found)[: max(limit, 0)]

    def _check_fence(self, fence: Fence | None, refused: str) -> None:
        if fence is not None and self._fences.get(fence.lease) != fence.token:
            current = self._fences.get(fence.lease)
            raise StaleFencingToken(
                f"{refused}: fencing token {fence.token} of lease {fence.lease} is stale "
                f"(current {current or 'none'})",
                field=fence.lease,
            )

    @staticmethod
    def _apply(record: JobRecord, update: JobUpdate | None) -> JobRecord:
        if update is None:
            return record
        changes = {
            name: copy.deepcopy(value)
            for name, value in vars(update).items()
            if value is not None
        }
        return replace(record, **changes)

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
        with self._lock:
            record = self._job(job_id)
            self._check_fence(fence, f"job {job_id}: {expected.value} -> {new.value} refused")
            if record.status != expected:
                raise IllegalTransition(
                    f"job {job_id} is {record.status.value}, not {expected.value}: cannot "
                    f"change it to {new.value}",
                    field="status",
                )
            if not is_allowed(record.status, new):
                raise IllegalTransition(
                    f"job {job_id}: {record.status.value} -> {new.value} is not an allowed "
                    f"status change",
                    field="status",
                )
            now = _now_ms()
            record = replace(
                self._apply(record, update),
                status=new,
                start_time_ms=now if new == JobStatus.RUNNING else record.start_time_ms,
                end_time_ms=now if new.is_final else record.end_time_ms,
                history=[*record.history, StatusChange(expected, new, reason, now)],
            )
            self._jobs[job_id] = record
            return copy.deepcopy(record)

    def update_job(
        self,
        job_id: str,
        update: JobUpdate,
        *,
        fence: Fence | None = None,
        expected: JobStatus | None = None,
    ) -> JobRecord:
        with self._lock:
            record = self._job(job_id)
            self._check_fence(fence, f"job {job_id}: update refused")
            if expected is not None and record.status != expected:
                raise IllegalTransition(
                    f"job {job_id} is {record.status.value}, not {expected.value}; "
                    "job not updated",
                    field="status",
                )
            record = self._apply(record, update)
            self._jobs[job_id] = record
            return copy.deepcopy(record)

    def delete_job(self, job_id: str) -> bool:
        with self._lock:
            return self._jobs.pop(job_id, None) is not None

    # leases ---------------------------------------------------------------------------------
    def _live_lease(self, name: str) -> tuple[str, int] | None:
        lease = self._leases.get(name)
        if lease is None or not lease.alive():
            return None
        holder_token: tuple[str, int] = lease.value
        return holder_token

    def acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        with self._lock:
            current = self._live_lease(name)
            if current is not None and current[0] != holder:
                return None
            token = current[1] if current is not None else self._fences.get(name, 0) + 1
            self._fences[name] = token
            self._leases[name] = _Expiring((holder, token), time.monotonic() + ttl_s)
            return token

    def renew(self, name: str, holder: str, token: int, ttl_s: float) -> None:
        with self._lock:
            current = self._live_lease(name)
            held = current == (holder, token) if current else self._fences.get(name) == token
            if not held:
                raise LeaseNotHeld(
                    f"lease {name} is no longer held by {holder} with token {token}", field=name
                )
            self._leases[name] = _Expiring((holder, token), time.monotonic() + ttl_s)

    def take_over(self, name: str, holder: str, ttl_s: float, *, previous: str) -> int | None:
        with self._lock:
            current = self._live_lease(name)
            if current is not None and current[0] not in (holder, previous):
                return None
            token = self._fences.get(name, 0) + 1
            self._fences[name] = token
            self._leases[name] = _Expiring((holder, token), time.monotonic() + ttl_s)
            return token

    def release(self, name: str, holder: str, token: int) -> bool:
        with self._lock:
            if self._live_lease(name) != (holder, token):
                return False
            del self._leases[name]
            return True

    def get_lease(self, name: str) -> Lease | None:
        with self._lock:
            current = self._live_lease(name)
            if current is None:
                return None
            left = self._leases[name].expires_at - time.monotonic()
            return Lease(name, current[0], current[1], max(left, 0.0))

    # sites ----------------------------------------------------------------------------------
    def record_heartbeat(self, beat: SiteHeartbeat, ttl_s: float) -> None:
        with self._lock:
            self._sites[beat.site] = _Expiring(copy.deepcopy(beat), time.monotonic() + ttl_s)

    def get_site(self, site: str) -> SiteHeartbeat | None:
        with self._lock:
            entry = self._sites.get(site)
            if entry is None or not entry.alive():
                return None
            beat: SiteHeartbeat = copy.deepcopy(entry.value)
            return beat

    def live_sites(self) -> list[SiteHeartbeat]:
        with self._lock:
            return [
                copy.deepcopy(self._sites[site].value)
                for site in sorted(self._sites)
                if self._sites[site].alive()
            ]

    def known_sites(self) -> list[str]:
        with self._lock:
            return sorted(self._sites)

    # site presence --------------------------------------------------------------------------
    def record_heartbeats(self, beats: Sequence[SiteHeartbeat], ttl_s: float) -> list[str]:
        born: list[str] = []
        with self._lock:
            for beat in beats:
                if beat.sent_at_ms < self._seen_ms.get(beat.site, beat.sent_at_ms):
                    continue
                self._sites[beat.site] = _Expiring(copy.deepcopy(beat), time.monotonic() + ttl_s)
                self._seen_ms[beat.site] = beat.sent_at_ms
                self._last[beat.site] = copy.deepcopy(beat)
                if beat.site not in self._online:
                    self._online.add(beat.site)
                    born.append(beat.site)
        return born

    def mark_offline(self, beat: SiteHeartbeat) -> bool:
        with self._lock:
            if beat.sent_at_ms < self._seen_ms.get(beat.site, beat.sent_at_ms):
                return False
            # known forever: the entry stays, its life ends now
            self._sites[beat.site] = _Expiring(copy.deepcopy(beat), time.monotonic())
            self._seen_ms[beat.site] = beat.sent_at_ms
            self._last[beat.site] = copy.deepcopy(beat)
            was_online = beat.site in self._online
            self._online.discard(beat.site)
            return was_online

    def sweep_expired(self) -> list[SiteHeartbeat]:
        with self._lock:
            gone = sorted(site for site in self._online if not self._sites[site].alive())
            self._online.difference_update(gone)
            return [copy.deepcopy(self._last[site]) for site in gone]

    def last_heartbeats(self) -> dict[str, SiteHeartbeat]:
        with self._lock:
            return {site: copy.deepcopy(self._last[site]) for site in sorted(self._last)}

    def online_sites(self) -> list[str]:
        with self._lock:
            return sorted(self._online)

    def record_job_heartbeats(self, beats: Sequence[JobHeartbeat], ttl_s: float) -> None:
        with self._lock:
            for beat in beats:
                kept = self._job_beats.get((beat.job_id, beat.site))
                if not beat.ended and kept is not None and kept.alive() and kept.value.ended:
                    continue
                expires = time.monotonic() + ttl_s
                self._job_beats[(beat.job_id, beat.site)] = _Expiring(beat, expires)

    def get_job_heartbeat(self, job_id: str, site: str) -> JobHeartbeat | None:
        return self.get_job_heartbeats(job_id, [site]).get(site)

    def get_job_heartbeats(self, job_id: str, sites: Sequence[str]) -> dict[str, JobHeartbeat]:
        with self._lock:
            entries = {site: self._job_beats.get((job_id, site)) for site in sites}
            return {site: entry.value for site, entry in entries.items()
                    if entry is not None and entry.alive()}

    # idempotency ----------------------------------------------------------------------------
    def claim(self, scope: str, message_id: str, ttl_s: float) -> bool:
        with self._lock:
            entry = self._claims.get((scope, message_id))
            if entry is not None and entry.alive():
                return False
            self._claims[(scope, message_id)] = _Expiring("1", time.monotonic() + ttl_s)
            return True

    def remember(self, scope: str, key: str, value: str, ttl_s: float) -> str:
        with self._lock:
            entry = self._claims.get((scope, key))
            if entry is not None and entry.alive():
                kept: str = entry.value
                return kept
            self._claims[(scope, key)] = _Expiring(value, time.monotonic() + ttl_s)
            return value
