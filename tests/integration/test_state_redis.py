"""What only the Redis adapter has: the key layout, index entries as raw Redis sees them, the
generated script as Redis runs it, and connection failures surfacing as Unavailable."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import cast

import pytest
import redis

from fedhive.config import Settings
from fedhive.errors import Unavailable
from fedhive.jobs.status import TRANSITIONS, JobStatus
from fedhive.names import Names
from fedhive.retry import Backoff
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import RedisStateStore
from fedhive.state.scripts import OK, render_change_status
from tests.fixtures.state import submit, submit_in

S = JobStatus


@pytest.fixture
def raw(settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    yield client
    client.close()


def test_index_entries_match_records(
    redis_state: RedisStateStore, raw: redis.Redis, settings: Settings
) -> None:
    names = Names(settings.namespace)
    submit_in(redis_state, "job-a", S.RUNNING)
    submit_in(redis_state, "job-b", S.FINISHED_ABORTED)
    submit(redis_state, "job-c")

    def index(key: str) -> dict[str, float]:
        return dict(cast(list[tuple[str, float]], raw.zrange(key, 0, -1, withscores=True)))

    submitted = index(names.jobs_by_submit_key)
    assert list(submitted) == ["job-a", "job-b", "job-c"]
    for status in JobStatus:
        members = index(names.jobs_by_status_key(status.value))
        expected = [r.job_id for r in redis_state.list_jobs() if r.status == status]
        assert list(members) == expected, status
        assert all(score == submitted[job_id] for job_id, score in members.items())
    assert raw.hget(names.job_key("job-a"), "status") == "RUNNING"
    history = [json.loads(e) for e in raw.lrange(names.job_history_key("job-a"), 0, -1)]
    assert [e["to"] for e in history] == ["SUBMITTED", "DISPATCHED", "RUNNING"]
    assert raw.ttl(names.job_key("job-a")) == -1  # job records never expire


def test_heartbeat_keys_and_registry(
    redis_state: RedisStateStore, raw: redis.Redis, settings: Settings
) -> None:
    names = Names(settings.namespace)
    redis_state.record_heartbeat(SiteHeartbeat("site-1", sent_at_ms=5), ttl_s=30)
    assert 0 < raw.pttl(names.site_key("site-1")) <= 30_000
    assert raw.zscore(names.sites_key, "site-1") == 5


def test_the_script_enforces_the_table_it_was_generated_from(
    redis_state: RedisStateStore, raw: redis.Redis, settings: Settings
) -> None:
    """A script rendered from another table allows exactly that table's changes."""
    names = Names(settings.namespace)
    custom = render_change_status({(S.SUBMITTED, S.RUNNING)})
    submit(redis_state, "job-1")

    def run(old: JobStatus, new: JobStatus) -> str:
        keys = [
            names.job_key("job-1"),
            names.job_history_key("job-1"),
            names.jobs_by_submit_key,
            names.jobs_by_status_key(old.value),
            names.jobs_by_status_key(new.value),
        ]
        reply = raw.eval(custom.source, len(keys), *keys, "job-1", old.value, new.value, "r", "")
        return str(reply[0])

    assert (S.SUBMITTED, S.DISPATCHED) in TRANSITIONS
    assert run(S.SUBMITTED, S.DISPATCHED) == "ILLEGAL"  # legal in fedhive, not in `custom`
    assert run(S.SUBMITTED, S.RUNNING) == OK
    assert redis_state.get_job("job-1").status == S.RUNNING


def test_unreachable_redis_is_unavailable_after_retries() -> None:
    store = RedisStateStore.from_settings(
        Settings(redis_url="redis://127.0.0.1:1/0", namespace="unreachable"),
        backoff=Backoff(base=0.01, cap=0.02, max_attempts=3),
    )
    try:
        with pytest.raises(Unavailable, match=r"127\.0\.0\.1:1 unavailable for get job job-1"):
            store.get_job("job-1")
        with pytest.raises(Unavailable):
            store.acquire("scheduler", "a", 10)
    finally:
        store.close()
