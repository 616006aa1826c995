"""The Redis adapter of the state port.

Every job write is one Lua script (see `fedhive.state.scripts`), so records, status indexes
and history never disagree. Keys come from `Names`: every script and transaction touches one
hash slot, so the Redis may be standalone, replicated, Sentinel or a Redis Cluster
(`fedhive.state.connect`). The two operations that span a job's two slots (the namespace's and
the job's own) are ordered steps: `create_job` marks the job live in its slot before it
creates the record, `delete_job` deletes the job's data (live mark first) before the record;
a crash between the steps leaves what a retry of the same call finishes. Retries and error
translation are `fedhive.state.redis_base`'s, the sites' keys `fedhive.state.redis_presence`'s.
A retried write whose first attempt did reach Redis answers as a repeat would (AlreadyExists,
IllegalTransition); callers are idempotent on message ids anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import structlog

from fedhive.errors import (
    AlreadyExists,
    IllegalTransition,
    LeaseNotHeld,
    NotFound,
    StaleFencingToken,
)
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import INITIAL, JobStatus
from fedhive.names import Names
from fedhive.state import codec, scripts
from fedhive.state.port import Fence, JobUpdate, Lease
from fedhive.state.redis_base import ms
from fedhive.state.redis_presence import RedisPresence

log = structlog.get_logger()

SCAN_COUNT = 1000  # index entries Redis examines per ZSCAN call of `find_job_ids`


def prefix_pattern(prefix: str) -> str:
    """A Redis glob for what starts with `prefix`, ignoring case: ASCII letters become `[aA]`,
    glob characters are escaped; from the first non-ASCII character on (Redis matches bytes)
    anything goes, and the caller compares exactly."""
    parts = []
    for char in prefix:
        if not char.isascii():
            break
        if char.isalpha():
            parts.append(f"[{char.lower()}{char.upper()}]")
        elif char in "*?[]\\^":
            parts.append("\\" + char)
        else:
            parts.append(char)
    return "".join(parts) + "*"


class RedisStateStore(RedisPresence):
    """Implements `fedhive.state.port.StateStore` on one Redis or Redis Cluster: jobs and
    leases here, sites in `RedisPresence`, retries in `RedisBase`."""

    def _job_reply(self, job_id: str, reply: list[Any]) -> JobRecord:
        key = self._names.job_key(job_id)
        return codec.record_from_redis(key, codec.pairs_to_dict(reply[1]), reply[2])

    @staticmethod
    def _fence_parts(fence: Fence | None, names: Names) -> tuple[list[str], str]:
        if fence is None:
            return [], ""
        return [names.fence_key(fence.lease)], str(fence.token)

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
        n = self._names
        keys = [
            n.job_key(job_id),
            n.job_history_key(job_id),
            n.jobs_by_submit_key,
            n.jobs_by_status_key(INITIAL.value),
        ]
        fields = codec.create_fields(meta, submitter, archive_key, resumed_from)
        args = [job_id, reason, *fields]
        live = n.job_live_key(job_id)  # first: the job's slot knows the job before anyone can
        self._call(f"create job {job_id}", lambda: self._client.set(live, "1"))
        reply = self._script(f"create job {job_id}", scripts.CREATE_JOB, keys, args)
        if reply[0] == scripts.EXISTS:
            raise AlreadyExists(f"job {job_id} already exists", field="job_id")
        return self._job_reply(job_id, reply)

    def get_job(self, job_id: str) -> JobRecord:
        records = self._read_jobs(f"get job {job_id}", [job_id])
        if not records:
            raise NotFound(f"job {job_id} not found", field="job_id")
        return records[0]

    def list_jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        index = (
            self._names.jobs_by_submit_key
            if status is None
            else self._names.jobs_by_status_key(status.value)
        )
        what = f"list jobs in {index}"
        ids = cast(list[str], self._call(what, lambda: self._client.zrange(index, 0, -1)))
        return self._read_jobs(what, ids)

    def recent_job_ids(
        self, status: JobStatus | None = None, *, start: int = 0, count: int = 100
    ) -> list[str]:
        index = (
            self._names.jobs_by_submit_key
            if status is None
            else self._names.jobs_by_status_key(status.value)
        )
        if count <= 0:
            return []
        stop = start + count - 1
        return cast(
            list[str],
            self._call(
                f"list jobs in {index}", lambda: self._client.zrevrange(index, start, stop)
            ),
        )

    def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        return self._read_jobs(f"read {len(job_ids)} jobs", job_ids)

    def find_job_ids(self, prefix: str, *, limit: int) -> list[str]:
        """ZSCAN of the submission index with a case-insensitive MATCH pattern: Redis filters
        the ids, only matches come back, in batches of `SCAN_COUNT` ids examined."""
        if limit <= 0:
            return []
        index = self._names.jobs_by_submit_key
        pattern, wanted = prefix_pattern(prefix), prefix.lower()
        found: set[str] = set()
        cursor = 0

        def scan(at: int) -> tuple[int, list[tuple[str, float]]]:
            return cast(tuple[int, list[tuple[str, float]]],
                        self._client.zscan(index, at, match=pattern, count=SCAN_COUNT))

        while True:
            cursor, batch = self._call(f"find jobs {prefix!r} in {index}",
                                       functools.partial(scan, cursor))
            # A rehash may repeat a member; the pattern may let a non-ASCII near miss through.
            found.update(m for m, _ in batch if m.lower().startswith(wanted))
            if cursor == 0 or len(found) >= limit:
                return sorted(found)[:limit]

    def _read_jobs(self, what: str, ids: Sequence[str]) -> list[JobRecord]:
        """Records with their history, skipping ids deleted since they were listed."""

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self._names.job_key(job_id))
                pipe.lrange(self._names.job_history_key(job_id), 0, -1)
            return pipe.execute()

        replies = self._call(what, read) if ids else []
        return [
            codec.record_from_redis(self._names.job_key(job_id), fields, history)
            for job_id, fields, history in zip(ids, replies[::2], replies[1::2], strict=True)
            if fields
        ]

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
        n = self._names
        fence_keys, token = self._fence_parts(fence, n)
        keys = [
            n.job_key(job_id),
            n.job_history_key(job_id),
            n.jobs_by_submit_key,
            n.jobs_by_status_key(expected.value),
            n.jobs_by_status_key(new.value),
            *fence_keys,
        ]
        args = [job_id, expected.value, new.value, reason, token, *codec.update_fields(update)]
        what = f"job {job_id} {expected.value} -> {new.value}"
        reply = self._script(what, scripts.CHANGE_STATUS, keys, args)
        code, current = reply[0], reply[1]
        if code == scripts.OK:
            record = self._job_reply(job_id, reply)
            log.info("job_status_changed", job_id=job_id, old=expected.value, new=new.value)
            return record
        if code == scripts.NOT_FOUND:
            raise NotFound(f"job {job_id} not found", field="job_id")
        if code == scripts.STALE_FENCE:
            assert fence is not None
            raise StaleFencingToken(
                f"job {job_id}: {expected.value} -> {new.value} refused: fencing token "
                f"{fence.token} of lease {fence.lease} is stale (current {current or 'none'})",
                field=fence.lease,
            )
        if code == scripts.STALE_STATUS:
            raise IllegalTransition(
                f"job {job_id} is {current}, not {expected.value}: cannot change it to "
                f"{new.value}",
                field="status",
            )
        raise IllegalTransition(
            f"job {job_id}: {current} -> {new.value} is not an allowed status change",
            field="status",
        )

    def update_job(
        self,
        job_id: str,
        update: JobUpdate,
        *,
        fence: Fence | None = None,
        expected: JobStatus | None = None,
    ) -> JobRecord:
        n = self._names
        fence_keys, token = self._fence_parts(fence, n)
        keys = [n.job_key(job_id), n.job_history_key(job_id), *fence_keys]
        args = [token, expected.value if expected else "", *codec.update_fields(update)]
        reply = self._script(f"update job {job_id}", scripts.UPDATE_JOB, keys, args)
        if reply[0] == scripts.NOT_FOUND:
            raise NotFound(f"job {job_id} not found", field="job_id")
        if reply[0] == scripts.STALE_STATUS:
            assert expected is not None
            raise IllegalTransition(
                f"job {job_id} is {reply[1]}, not {expected.value}; job not updated",
                field="status",
            )
        if reply[0] == scripts.STALE_FENCE:
            assert fence is not None
            raise StaleFencingToken(
                f"job {job_id}: fencing token {fence.token} of lease {fence.lease} is stale "
                f"(current {reply[1] or 'none'}); job not updated",
                field=fence.lease,
            )
        return self._job_reply(job_id, reply)

    def delete_job(self, job_id: str) -> bool:
        """The job's data (its slot; the live mark first, so no log line lands after) goes
        before its record and index entries (the namespace slot): after a crash between them
        the record is still listed, and deleting it again finishes the job."""
        n = self._names
        data = [n.job_live_key(job_id), n.job_rounds_key(job_id), *n.job_log_keys(job_id)]
        self._call(f"delete job {job_id} data", lambda: self._client.delete(*data))
        own = [n.job_key(job_id), n.job_history_key(job_id)]
        keys = [
            *own,
            n.jobs_by_submit_key,
            *(n.jobs_by_status_key(status.value) for status in JobStatus),
        ]
        return bool(self._script(f"delete job {job_id}", scripts.DELETE_JOB, keys,
                                 [job_id, str(len(own))]))

    # leases ---------------------------------------------------------------------------------
    def _lease_keys(self, name: str) -> list[str]:
        return [self._names.lease_key(name), self._names.fence_key(name)]

    def acquire(self, name: str, holder: str, ttl_s: float) -> int | None:
        keys = self._lease_keys(name)
        token = self._script(
            f"acquire lease {name}", scripts.ACQUIRE_LEASE, keys, [holder, ms(ttl_s)]
        )
        return None if token is None else int(token)

    def renew(self, name: str, holder: str, token: int, ttl_s: float) -> None:
        keys = self._lease_keys(name)
        renewed = self._script(
            f"renew lease {name}", scripts.RENEW_LEASE, keys, [holder, token, ms(ttl_s)]
        )
        if not renewed:
            raise LeaseNotHeld(
                f"lease {name} is no longer held by {holder} with token {token}", field=name
            )

    def take_over(self, name: str, holder: str, ttl_s: float, *, previous: str) -> int | None:
        keys = self._lease_keys(name)
        token = self._script(
            f"take over lease {name}", scripts.TAKE_OVER_LEASE, keys,
            [holder, previous, ms(ttl_s)],
        )
        return None if token is None else int(token)

    def release(self, name: str, holder: str, token: int) -> bool:
        keys = self._lease_keys(name)
        released = self._script(
            f"release lease {name}", scripts.RELEASE_LEASE, keys, [holder, token]
        )
        return bool(released)

    def get_lease(self, name: str) -> Lease | None:
        key = self._names.lease_key(name)

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=True)
            pipe.hgetall(key)
            pipe.pttl(key)
            return pipe.execute()

        fields, ttl_ms = self._call(f"read lease {name}", read)
        if not fields:
            return None
        return Lease(name, fields["holder"], int(fields["token"]), max(ttl_ms, 0) / 1000)

    # idempotency ----------------------------------------------------------------------------
    def remember(self, scope: str, key: str, value: str, ttl_s: float) -> str:
        name = self._names.idempotency_key(scope, key)

        def once() -> str | None:
            if self._client.set(name, value, nx=True, px=ms(ttl_s)):
                return value
            return cast(str | None, self._client.get(name))  # None: it expired meanwhile

        while True:
            kept = self._call(f"remember {name}", once)
            if kept is not None:
                return kept

    def claim(self, scope: str, message_id: str, ttl_s: float) -> bool:
        key = self._names.idempotency_key(scope, message_id)
        return bool(
            self._call(
                f"claim {key}", lambda: self._client.set(key, "1", nx=True, px=ms(ttl_s))
            )
        )
