"""Contract of `SitePresence` (registry transitions and job heartbeats); runs against Redis and
in memory through the `state_store` fixture."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fedhive.config import Settings
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.state import RedisStateStore, StateStore
from tests.fixtures.infra import wait_for


def beat(site: str, sent_at_ms: int = 1_000, jobs: list[str] | None = None) -> SiteHeartbeat:
    return SiteHeartbeat(site=site, org="org-a", running_job_ids=jobs or [],
                         resources={"num_gpus": 1}, agent_version="0.1.0", sent_at_ms=sent_at_ms)


def test_first_heartbeat_goes_online_once(state_store: StateStore) -> None:
    assert state_store.record_heartbeats([beat("a"), beat("b")], ttl_s=30) == ["a", "b"]
    assert state_store.record_heartbeats([beat("a", 2_000)], ttl_s=30) == []
    assert state_store.online_sites() == ["a", "b"]
    assert state_store.get_site("a") == beat("a", 2_000)
    assert state_store.known_sites() == ["a", "b"]


def test_a_stale_heartbeat_is_ignored(state_store: StateStore) -> None:
    state_store.record_heartbeats([beat("a", 2_000, ["job-new"])], ttl_s=30)
    assert state_store.record_heartbeats([beat("a", 1_000, ["job-old"])], ttl_s=30) == []
    live = state_store.get_site("a")
    assert live is not None and live.running_job_ids == ["job-new"]


def test_goodbye_takes_a_site_offline_once(state_store: StateStore) -> None:
    state_store.record_heartbeats([beat("a")], ttl_s=30)
    assert state_store.mark_offline(beat("a", 2_000)) is True
    assert state_store.mark_offline(beat("a", 2_000)) is False
    assert state_store.get_site("a") is None
    assert state_store.online_sites() == []
    assert state_store.known_sites() == ["a"]
    # a heartbeat sent before the goodbye (delivered late) does not bring it back ...
    assert state_store.record_heartbeats([beat("a", 1_500)], ttl_s=30) == []
    assert state_store.get_site("a") is None
    # ... a later one does
    assert state_store.record_heartbeats([beat("a", 3_000)], ttl_s=30) == ["a"]


def test_goodbye_of_a_site_never_online_is_no_transition(state_store: StateStore) -> None:
    assert state_store.mark_offline(beat("ghost")) is False
    assert state_store.online_sites() == []


def test_expired_site_is_swept_once_with_its_last_heartbeat(state_store: StateStore) -> None:
    state_store.record_heartbeats([beat("a", jobs=["job-1"])], ttl_s=0.2)
    state_store.record_heartbeats([beat("b")], ttl_s=30)
    assert state_store.sweep_expired() == []
    wait_for(lambda: state_store.get_site("a") is None, timeout=5, what="site a TTL")
    assert state_store.sweep_expired() == [beat("a", jobs=["job-1"])]
    assert state_store.sweep_expired() == []
    assert state_store.online_sites() == ["b"]
    assert state_store.record_heartbeats([beat("a", 5_000)], ttl_s=30) == ["a"]


def test_concurrent_callers_see_each_transition_once(state_store: StateStore) -> None:
    def record(i: int) -> list[str]:
        return state_store.record_heartbeats([beat(f"s{j}", 1_000 + i) for j in range(20)], 30)

    with ThreadPoolExecutor(8) as pool:
        born = [site for sites in pool.map(record, range(8)) for site in sites]
    assert sorted(born) == sorted(f"s{j}" for j in range(20))

    def goodbye(i: int) -> bool:
        return state_store.mark_offline(beat("s0", 10_000))

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(goodbye, range(8))) == 1


def test_job_heartbeat_is_kept_until_its_ttl(state_store: StateStore) -> None:
    first = JobHeartbeat(job_id="job-1", site="a", sent_at_ms=1, current_task="train",
                         progress=0.5)
    other = JobHeartbeat(job_id="job-1", site="b", sent_at_ms=1)
    state_store.record_job_heartbeats([first, other], ttl_s=0.3)
    assert state_store.get_job_heartbeat("job-1", "a") == first
    assert state_store.get_job_heartbeat("job-1", "b") == other
    assert state_store.get_job_heartbeat("job-2", "a") is None
    wait_for(lambda: state_store.get_job_heartbeat("job-1", "a") is None, timeout=5,
             what="job heartbeat TTL")


def test_a_jobs_heartbeats_are_read_in_one_call(state_store: StateStore) -> None:
    beats = [JobHeartbeat(job_id="job-1", site=site, sent_at_ms=1) for site in ("a", "b")]
    state_store.record_job_heartbeats(
        [*beats, JobHeartbeat(job_id="job-2", site="c", sent_at_ms=1)], ttl_s=30)
    assert state_store.get_job_heartbeats("job-1", ["a", "b", "c", "d"]) == {
        "a": beats[0], "b": beats[1]}  # c beats for another job, d never did
    assert state_store.get_job_heartbeats("job-1", []) == {}


def test_a_client_jobs_end_is_its_last_word(state_store: StateStore) -> None:
    ended = JobHeartbeat(job_id="job-1", site="a", sent_at_ms=5, ended=True, exit_code=-9,
                         reason="killed by signal 9 (SIGKILL)")
    late = JobHeartbeat(job_id="job-1", site="a", sent_at_ms=6, current_task="train")
    state_store.record_job_heartbeats([ended], ttl_s=30)
    state_store.record_job_heartbeats([late], ttl_s=30)  # sent before the end, arrived after
    assert state_store.get_job_heartbeat("job-1", "a") == ended
    again = JobHeartbeat(job_id="job-1", site="a", sent_at_ms=7, ended=True, exit_code=1,
                         reason="exited with code 1")
    state_store.record_job_heartbeats([late, again], ttl_s=30)
    assert state_store.get_job_heartbeat("job-1", "a") == again


def test_a_new_store_instance_sees_the_same_online_set(
    redis_state: RedisStateStore, settings: Settings
) -> None:
    """A restarted (or second) intake starts from the online set kept in Redis."""
    redis_state.record_heartbeats([beat("a")], ttl_s=30)
    again = RedisStateStore.from_settings(settings)
    try:
        assert again.online_sites() == ["a"]
        assert again.record_heartbeats([beat("a", 2_000)], ttl_s=30) == []
        assert again.mark_offline(beat("a", 3_000)) is True
        assert redis_state.online_sites() == []
    finally:
        again.close()
