"""The Redis adapter of the state port.

Every job write is one Lua script (see `fedhive.state.scripts`), so records, status indexes
and history never disagree. Keys come from `Names`: every script and transaction touches one
hash slot, so the Redis may be standalone, replicated, Sentinel or a Redis Cluster
(`fedhive.state.connect`). The two operations that span a job's two slots (the namespace's and
the job's own) are ordered steps: `create_job` marks the job live in its slot before it
creates the record, `delete_job` deletes the job's data (live mark first) before the record;
a crash between the steps leaves what a retry of the same call finishes. Connection failures
are retried with the shared `Backoff` policy and then surface as `Unavailable`; a certificate
not accepted or cluster mode set wrong is a ConfigError at once. A retried write whose first
attempt did reach Redis answers as a repeat would (AlreadyExists, IllegalTransition); callers
are idempotent on message ids anyway.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar, cast

import redis
import structlog
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

from fedhive.config import Settings
from fedhive.errors import (
    AlreadyExists,
    IllegalTransition,
    LeaseNotHeld,
    NotFound,
    StaleFencingToken,
    Unavailable,
)
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import INITIAL, JobStatus
from fedhive.names import Names
from fedhive.retry import Backoff
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import site_heartbeat_from_dict, site_heartbeat_to_dict
from fedhive.state import codec, connect, presence_scripts, scripts
from fedhive.state.port import Fence, JobUpdate, Lease

T = TypeVar("T")
log = structlog.get_logger()

DEFAULT_BACKOFF = Backoff(base=0.05, cap=1.0, max_attempts=6)
# MovedError: on a cluster client, a slot that moved again while redis-py followed it.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, MovedError)
SCAN_COUNT = 1000  # index entries Redis examines per ZSCAN call of `find_job_ids`


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


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


class RedisStateStore:
    """Implements `fedhive.state.port.StateStore` on one Redis or Redis Cluster."""

    def __init__(
        self, client: connect.RedisClient, names: Names, *, where: str,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._names = names
        self._where = where  # host:port, for error messages (never the password)
        self._backoff = backoff

    @classmethod
    def from_settings(
        cls, settings: Settings, *, backoff: Backoff = DEFAULT_BACKOFF
    ) -> RedisStateStore:
        return cls(connect.redis_client(settings), Names(settings.namespace),
                   where=connect.where(settings), backoff=backoff)

    def close(self) -> None:
        self._client.close()

    # plumbing -------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        def on_retry(err: BaseException, wait: float) -> None:
            log.warning("redis_retry", op=what, error=str(err), wait_s=round(wait, 3))

        def attempt() -> T:
            try:
                return fn()
            except redis.RedisError as err:
                problem = connect.config_problem(err, self._where, cluster=self._cluster)
                if problem is not None:
                    raise problem from None  # no retry helps
                raise

        try:
            return self._backoff.call(attempt, _TRANSIENT, on_retry)
        except _TRANSIENT as err:
            raise Unavailable(f"redis at {self._where} unavailable for {what}: {err}") from err

    def _script(
        self, what: str, script: scripts.LuaScript, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        def run() -> Any:
            try:
                return self._client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return self._client.eval(script.source, len(keys), *keys, *args)

        return self._call(what, run)

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
            f"acquire lease {name}", scripts.ACQUIRE_LEASE, keys, [holder, _ms(ttl_s)]
        )
        return None if token is None else int(token)

    def renew(self, name: str, holder: str, token: int, ttl_s: float) -> None:
        keys = self._lease_keys(name)
        renewed = self._script(
            f"renew lease {name}", scripts.RENEW_LEASE, keys, [holder, token, _ms(ttl_s)]
        )
        if not renewed:
            raise LeaseNotHeld(
                f"lease {name} is no longer held by {holder} with token {token}", field=name
            )

    def take_over(self, name: str, holder: str, ttl_s: float, *, previous: str) -> int | None:
        keys = self._lease_keys(name)
        token = self._script(
            f"take over lease {name}", scripts.TAKE_OVER_LEASE, keys,
            [holder, previous, _ms(ttl_s)],
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

    # sites ----------------------------------------------------------------------------------
    def record_heartbeat(self, beat: SiteHeartbeat, ttl_s: float) -> None:
        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            value = json.dumps(site_heartbeat_to_dict(beat))
            pipe.set(self._names.site_key(beat.site), value, px=_ms(ttl_s))
            pipe.zadd(self._names.sites_key, {beat.site: beat.sent_at_ms})
            pipe.execute()

        self._call(f"record heartbeat of site {beat.site}", write)

    def get_site(self, site: str) -> SiteHeartbeat | None:
        key = self._names.site_key(site)
        raw = cast(str | None, self._call(f"read site {site}", lambda: self._client.get(key)))
        return None if raw is None else site_heartbeat_from_dict(json.loads(raw))

    def known_sites(self) -> list[str]:
        key = self._names.sites_key
        sites = cast(list[str], self._call("list sites", lambda: self._client.zrange(key, 0, -1)))
        return sorted(sites)

    def live_sites(self) -> list[SiteHeartbeat]:
        sites = self.known_sites()
        if not sites:
            return []
        keys = [self._names.site_key(site) for site in sites]
        raws = cast(list[str | None], self._call("read sites", lambda: self._client.mget(keys)))
        return [site_heartbeat_from_dict(json.loads(raw)) for raw in raws if raw is not None]

    # site presence (transitions decided in Lua, see fedhive.state.presence_scripts) ---------
    def _presence_keys(self) -> list[str]:
        n = self._names
        return [n.sites_key, n.sites_online_key, n.sites_last_key]

    def record_heartbeats(self, beats: Sequence[SiteHeartbeat], ttl_s: float) -> list[str]:
        if not beats:
            return []
        keys = [*self._presence_keys(), *(self._names.site_key(b.site) for b in beats)]
        args: list[Any] = [_ms(ttl_s)]
        for beat in beats:
            args += [beat.site, beat.sent_at_ms, json.dumps(site_heartbeat_to_dict(beat))]
        what = f"record {len(beats)} heartbeats"
        return cast(list[str], self._script(what, presence_scripts.RECORD_HEARTBEATS, keys, args))

    def mark_offline(self, beat: SiteHeartbeat) -> bool:
        keys = [*self._presence_keys(), self._names.site_key(beat.site)]
        args = [beat.site, beat.sent_at_ms, json.dumps(site_heartbeat_to_dict(beat))]
        what = f"mark site {beat.site} offline"
        return bool(self._script(what, presence_scripts.MARK_OFFLINE, keys, args) == 1)

    def sweep_expired(self) -> list[SiteHeartbeat]:
        n = self._names
        online = sorted(cast(set[str], self._call(
            "list online sites", lambda: self._client.smembers(n.sites_online_key))))
        if not online:
            return []
        keys = [n.sites_online_key, n.sites_last_key, *(n.site_key(site) for site in online)]
        reply = self._script("sweep expired sites", presence_scripts.SWEEP_EXPIRED, keys,
                             online)
        return [
            site_heartbeat_from_dict(json.loads(raw)) if raw else SiteHeartbeat(site=site)
            for site, raw in zip(reply[::2], reply[1::2], strict=True)
        ]

    def last_heartbeats(self) -> dict[str, SiteHeartbeat]:
        key = self._names.sites_last_key
        raws = cast(dict[str, str], self._call("read last heartbeats",
                                               lambda: self._client.hgetall(key)))
        return {site: site_heartbeat_from_dict(json.loads(raws[site])) for site in sorted(raws)}

    def online_sites(self) -> list[str]:
        key = self._names.sites_online_key
        return sorted(cast(set[str], self._call("list online sites",
                                                lambda: self._client.smembers(key))))

    def record_job_heartbeats(self, beats: Sequence[JobHeartbeat], ttl_s: float) -> None:
        by_job: dict[str, list[JobHeartbeat]] = {}
        for beat in beats:
            by_job.setdefault(beat.job_id, []).append(beat)
        for job_id, batch in by_job.items():  # one script per job: each job has its own slot
            keys = [self._names.job_heartbeat_key(job_id, beat.site) for beat in batch]
            args: list[Any] = [_ms(ttl_s)]
            for beat in batch:
                args += [json.dumps(asdict(beat)), int(beat.ended)]
            self._script(f"record {len(batch)} heartbeats of job {job_id}",
                         presence_scripts.RECORD_JOB_HEARTBEATS, keys, args)

    def get_job_heartbeat(self, job_id: str, site: str) -> JobHeartbeat | None:
        return self.get_job_heartbeats(job_id, [site]).get(site)

    def get_job_heartbeats(self, job_id: str, sites: Sequence[str]) -> dict[str, JobHeartbeat]:
        if not sites:
            return {}
        keys = [self._names.job_heartbeat_key(job_id, site) for site in sites]  # the job's slot
        raws = cast(list[str | None], self._call(f"read job {job_id} heartbeats",
                                                 lambda: self._client.mget(keys)))
        return {site: JobHeartbeat(**json.loads(raw))
                for site, raw in zip(sites, raws, strict=True) if raw is not None}

    # idempotency ----------------------------------------------------------------------------
    def remember(self, scope: str, key: str, value: str, ttl_s: float) -> str:
        name = self._names.idempotency_key(scope, key)

        def once() -> str | None:
            if self._client.set(name, value, nx=True, px=_ms(ttl_s)):
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
                f"claim {key}", lambda: self._client.set(key, "1", nx=True, px=_ms(ttl_s))
            )
        )
