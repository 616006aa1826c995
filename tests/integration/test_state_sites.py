"""Contract of site heartbeats and idempotency claims; runs against Redis and in memory."""

from __future__ import annotations

import threading

from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import StateStore
from tests.fixtures.infra import wait_for


def beat(site: str, jobs: list[str] | None = None) -> SiteHeartbeat:
    return SiteHeartbeat(
        site=site,
        org="org-a",
        running_job_ids=jobs or [],
        resources={"num_gpus": 2, "gpus": [{"id": 0, "free_mb": 40000.5}]},
        agent_version="0.1.0",
        sent_at_ms=1_700_000_000_000,
    )


def test_heartbeat_is_kept_until_its_ttl(state_store: StateStore) -> None:
    state_store.record_heartbeat(beat("site-1", ["job-1"]), ttl_s=30)
    state_store.record_heartbeat(beat("site-2"), ttl_s=0.3)
    assert state_store.get_site("site-1") == beat("site-1", ["job-1"])
    assert [b.site for b in state_store.live_sites()] == ["site-1", "site-2"]
    wait_for(lambda: state_store.get_site("site-2") is None, timeout=5, what="heartbeat TTL")
    assert [b.site for b in state_store.live_sites()] == ["site-1"]
    assert state_store.known_sites() == ["site-1", "site-2"]  # ever registered
    state_store.record_heartbeat(beat("site-2", ["job-9"]), ttl_s=30)
    assert state_store.get_site("site-2") == beat("site-2", ["job-9"])


def test_unknown_site_has_no_heartbeat(state_store: StateStore) -> None:
    assert state_store.get_site("nowhere") is None
    assert state_store.live_sites() == [] and state_store.known_sites() == []


def test_claim_succeeds_once(state_store: StateStore) -> None:
    assert state_store.claim("job-store", "msg-1", ttl_s=60) is True
    assert state_store.claim("job-store", "msg-1", ttl_s=60) is False
    assert state_store.claim("job-store", "msg-2", ttl_s=60) is True
    assert state_store.claim("scheduler", "msg-1", ttl_s=60) is True


def test_claim_is_free_again_after_its_ttl(state_store: StateStore) -> None:
    assert state_store.claim("job-store", "msg-1", ttl_s=0.2) is True
    wait_for(lambda: state_store.claim("job-store", "msg-1", ttl_s=60), timeout=5, what="claim TTL")
    assert state_store.claim("job-store", "msg-1", ttl_s=60) is False


def test_remember_keeps_the_first_value(state_store: StateStore) -> None:
    assert state_store.remember("submission", "alice:t1", "a job-1", ttl_s=60) == "a job-1"
    assert state_store.remember("submission", "alice:t1", "b job-2", ttl_s=60) == "a job-1"
    assert state_store.remember("submission", "bob:t1", "b job-2", ttl_s=60) == "b job-2"
    assert state_store.remember("other", "alice:t1", "c job-3", ttl_s=60) == "c job-3"


def test_remember_concurrent_callers_agree(state_store: StateStore) -> None:
    kept: list[str] = []
    lock = threading.Lock()

    def remember(n: int) -> None:
        value = state_store.remember("submission", "race", f"v{n}", ttl_s=60)
        with lock:
            kept.append(value)

    threads = [threading.Thread(target=remember, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(kept) == 8 and len(set(kept)) == 1


def test_remembered_value_expires(state_store: StateStore) -> None:
    assert state_store.remember("submission", "k", "first", ttl_s=0.2) == "first"
    wait_for(
        lambda: state_store.remember("submission", "k", "second", ttl_s=60) == "second",
        timeout=5,
        what="remembered value TTL",
    )


def test_last_heartbeats_outlive_the_live_record(state_store: StateStore) -> None:
    assert state_store.last_heartbeats() == {}
    beat = SiteHeartbeat("s1", resources={"total": {"gpu": 1}}, sent_at_ms=5)
    state_store.record_heartbeats([beat], 60)
    bye = SiteHeartbeat("s1", resources={"total": {"gpu": 2}}, sent_at_ms=6)
    assert state_store.mark_offline(bye)
    assert state_store.last_heartbeats() == {"s1": bye}
