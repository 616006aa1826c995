"""fedhive.sites.intake (sender verification, storing, transitions) on the in-memory store."""

from __future__ import annotations

import pytest

from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.sites import intake
from fedhive.sites.intake import IntakeConfig, Transition
from fedhive.state.memory_store import MemoryStateStore
from tests.fixtures.infra import wait_for

CONFIG = IntakeConfig(site_ttl_s=30, job_ttl_s=30)
NAMES = Names("ns")


def user(site: str | None) -> str | None:
    """The broker user of `site` in the tests' namespace (None: unsigned)."""
    return None if site is None else NAMES.site_user(site)


def beat(site: str, sent_at_ms: int = 1_000) -> site_pb2.SiteHeartbeat:
    return site_pb2.SiteHeartbeat(site=site, org="org-a", running_job_ids=["job-1"],
                                  agent_version="0.1", sent_at_ms=sent_at_ms)


def event(kind: str, site: str = "a", sent_at_ms: int = 1_000) -> intake.SiteEvent:
    return intake.accept(beat(site, sent_at_ms), f"site.{site}.{kind}", user(site), NAMES)


def test_patterns_cover_every_site_event() -> None:
    assert set(intake.PATTERNS) == {
        "site.*.heartbeat", "site.*.online", "site.*.offline", "site.*.job"
    }


def test_accept_decodes_a_matching_heartbeat() -> None:
    accepted = intake.accept(beat("a"), "site.a.heartbeat", user("a"), NAMES)
    assert accepted.kind == "heartbeat" and accepted.site == "a"
    assert accepted.beat is not None and accepted.beat.running_job_ids == ["job-1"]


@pytest.mark.parametrize(
    ("routing_key", "user_id", "payload_site"),
    [
        ("site.b.heartbeat", "a", "b"),  # A's connection speaking for B
        ("site.a.heartbeat", "a", "b"),  # payload names another site
        ("site.b.heartbeat", "b", "a"),
        ("site.a.heartbeat", None, "a"),  # unsigned
        ("site.a.offline", "b", "b"),
        ("site.a.heartbeat", "a@raw", "a"),  # a user named like the site, not its broker user
    ],
)
def test_accept_refuses_a_sender_that_is_not_the_site(
    routing_key: str, user_id: str | None, payload_site: str
) -> None:
    sender = "a" if user_id == "a@raw" else user(user_id)
    with pytest.raises(PermissionDenied) as err:
        intake.accept(beat(payload_site), routing_key, sender, NAMES)
    assert str(sender or "(none)") in str(err.value)
    assert routing_key.split(".")[1] in str(err.value)


def test_accept_refuses_a_job_beat_for_another_site() -> None:
    job = site_pb2.JobHeartbeat(job_id="job-1", site="b")
    with pytest.raises(PermissionDenied):
        intake.accept(job, "site.a.job", user("a"), NAMES)


@pytest.mark.parametrize("routing_key", ["site.a", "site..heartbeat", "job.a.heartbeat",
                                         "site.a.status", "site.a.b.heartbeat"])
def test_accept_refuses_a_malformed_routing_key(routing_key: str) -> None:
    with pytest.raises(MalformedMessage) as err:
        intake.accept(beat("a"), routing_key, user("a"), NAMES)
    assert err.value.field == "routing_key"


def test_accept_refuses_a_payload_of_the_wrong_kind() -> None:
    with pytest.raises(MalformedMessage):
        intake.accept(beat("a"), "site.a.job", user("a"), NAMES)
    with pytest.raises(MalformedMessage):
        intake.accept(site_pb2.JobHeartbeat(job_id="j", site="a"), "site.a.heartbeat", user("a"),
                      NAMES)
    with pytest.raises(MalformedMessage, match="job_id"):
        intake.accept(site_pb2.JobHeartbeat(site="a"), "site.a.job", user("a"), NAMES)


def test_an_unstamped_beat_gets_the_arrival_time() -> None:
    accepted = intake.accept(beat("a", sent_at_ms=0), "site.a.heartbeat", user("a"), NAMES)
    assert accepted.beat is not None and accepted.beat.sent_at_ms > 1_600_000_000_000


def test_store_announces_online_once_then_offline_on_goodbye() -> None:
    store = MemoryStateStore()
    first = intake.store(store, [event("online"), event("heartbeat", sent_at_ms=1_500)], CONFIG)
    assert [(t.routing_key, t.beat.sent_at_ms) for t in first] == [(Names.SITE_ONLINE, 1_500)]
    assert intake.store(store, [event("heartbeat", sent_at_ms=2_000)], CONFIG) == []
    gone = intake.store(store, [event("offline", sent_at_ms=3_000)], CONFIG)
    assert [(t.routing_key, t.beat.site) for t in gone] == [(Names.SITE_OFFLINE, "a")]
    assert store.get_site("a") is None
    assert intake.store(store, [event("offline", sent_at_ms=3_000)], CONFIG) == []


def test_store_keeps_job_heartbeats() -> None:
    store = MemoryStateStore()
    job = site_pb2.JobHeartbeat(job_id="job-1", site="a", current_task="train", progress=0.25,
                                sent_at_ms=5)
    assert intake.store(store, [intake.accept(job, "site.a.job", user("a"), NAMES)], CONFIG) == []
    kept = store.get_job_heartbeat("job-1", "a")
    assert kept is not None and kept.current_task == "train" and kept.progress == 0.25


def test_sweep_announces_each_expired_site_once() -> None:
    store = MemoryStateStore()
    intake.store(store, [event("heartbeat")], IntakeConfig(site_ttl_s=0.01))
    wait_for(lambda: store.get_site("a") is None, timeout=5, what="site a TTL")
    assert [t.beat.site for t in intake.sweep(store)] == ["a"]
    assert intake.sweep(store) == []


def test_transition_message_ids_are_stable() -> None:
    accepted = event("online").beat
    assert accepted is not None
    assert Transition(Names.SITE_ONLINE, accepted).message_id == "site.online:a:1000"


def test_config_refuses_non_positive_values() -> None:
    with pytest.raises(ValueError, match="site_ttl_s"):
        IntakeConfig(site_ttl_s=0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_vigil_trusts_only_a_view_whole_for_the_window() -> None:
    clock = Clock()
    vigil = intake.Vigil(clock)
    assert not vigil.trusts(90.0, 5)  # the store has not answered yet
    vigil.store_answered()  # at 100
    clock.now = 104.9
    assert not vigil.trusts(90.0, 5)
    clock.now = 105.0
    assert vigil.trusts(90.0, 5)
    assert not vigil.trusts(None, 5)  # the consumer is reconnecting
    assert not vigil.trusts(101.0, 5)  # reconnected 4 s ago: a whole TTL has not come in
    clock.now = 106.0
    assert vigil.trusts(101.0, 5)


def test_vigil_restarts_the_window_after_the_store_failed() -> None:
    clock = Clock()
    vigil = intake.Vigil(clock)
    vigil.store_answered()
    clock.now = 200.0
    assert vigil.whole_for(0.0) == 100.0
    vigil.store_failed()
    assert vigil.whole_for(0.0) == 0.0
    clock.now = 201.0
    vigil.store_answered()
    vigil.store_answered()  # later answers do not move the start
    clock.now = 203.0
    assert vigil.whole_for(0.0) == 2.0 and not vigil.trusts(0.0, 5)
