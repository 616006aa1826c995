"""The heartbeat intake on the real broker and Redis: storing, sender verification, registry
transitions (once, across restarts and replicas), job heartbeats, and the `fedhive-job-runner`
process running it end to end."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog

from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.sites import intake
from fedhive.sites.intake import IntakeConfig
from fedhive.state import RedisStateStore
from fedhive_services.job_runner.heartbeats import HeartbeatIntake
from tests.fixtures.bus import Broker
from tests.fixtures.infra import stop_process, wait_for
from tests.fixtures.job_store import service_env
from tests.fixtures.sites import SitePublisher, collect

Events = list[tuple[str, Any]]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def beat(site: str, sent_at_ms: int | None = None) -> site_pb2.SiteHeartbeat:
    return site_pb2.SiteHeartbeat(site=site, org="org-a", running_job_ids=["job-1"],
                                  agent_version="0.1", sent_at_ms=sent_at_ms or now_ms())


@pytest.fixture
def store(settings: Settings) -> Iterator[RedisStateStore]:
    state = RedisStateStore.from_settings(settings)
    yield state
    state.close()


@pytest.fixture
def start_intake(
    settings: Settings, store: RedisStateStore, broker: Broker
) -> Iterator[Callable[..., HeartbeatIntake]]:
    """`start(config)`: a running intake (its own bus); every one is closed at teardown."""
    running: list[tuple[HeartbeatIntake, RabbitBus]] = []

    def start(config: IntakeConfig) -> HeartbeatIntake:
        bus = RabbitBus(settings, name=f"intake-{len(running)}")
        heartbeats = HeartbeatIntake(bus, store, config, structlog.get_logger())
        heartbeats.start()
        running.append((heartbeats, bus))
        return heartbeats

    yield start
    for heartbeats, bus in running:
        heartbeats.close()
        bus.close()


@pytest.fixture
def transitions(settings: Settings, broker: Broker) -> Iterator[Events]:
    """Every `site.online` / `site.offline` event published in this test's namespace."""
    seen: Events = []
    bus = RabbitBus(settings, name="watch")
    bus.subscribe("watch", [Names.SITE_ONLINE, Names.SITE_OFFLINE], collect(seen),
                  [site_pb2.SiteHeartbeat])
    yield seen
    bus.close()


def summary(events: Events) -> list[tuple[str, str]]:
    return [(key, message.site) for key, message in events]


def stored_at(store: RedisStateStore, site: str) -> int | None:
    live = store.get_site(site)
    return None if live is None else live.sent_at_ms


def test_heartbeats_are_stored_with_ttl_and_announced_online_once(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore, transitions: Events, settings: Settings,
) -> None:
    start_intake(IntakeConfig(site_ttl_s=30))
    times = [now_ms() + i for i in range(3)]
    for sent in times:
        site_publisher.as_site("site-1", "heartbeat", beat("site-1", sent))
    wait_for(lambda: stored_at(store, "site-1") == times[-1], what="the last heartbeat stored")
    raw = redis.Redis.from_url(settings.redis_url)
    try:
        ttl_ms = raw.pttl(Names(settings.namespace).site_key("site-1"))
    finally:
        raw.close()
    assert 0 < ttl_ms <= 30_000
    wait_for(lambda: transitions, what="site.online")
    site_publisher.as_site("site-2", "online", beat("site-2"))  # later than site-1's events
    wait_for(lambda: len(transitions) == 2, what="site.online of site-2")
    assert summary(transitions) == [(Names.SITE_ONLINE, "site-1"), (Names.SITE_ONLINE, "site-2")]
    assert transitions[0][1].sent_at_ms in times  # the newest beat of the batch that did it
    assert store.online_sites() == ["site-1", "site-2"]


def test_a_heartbeat_naming_another_site_is_refused(
    start_intake: Callable[..., HeartbeatIntake], site_users: Callable[..., dict[str, Settings]],
    store: RedisStateStore, transitions: Events, namespace: str,
) -> None:
    a, b = f"{namespace}-a", f"{namespace}-b"
    users = site_users([a])
    start_intake(IntakeConfig(site_ttl_s=30))
    site = RabbitBus(users[a], name="site-a", site=True)  # user_id: a's broker user
    try:
        site.publish_event(Names.site_event(a, "heartbeat"), beat(b))  # payload claims b
        site.publish_event(Names.site_event(a, "job"), site_pb2.JobHeartbeat(job_id="j", site=b))
        site.publish_event(Names.site_event(a, "heartbeat"), beat(a))  # a speaking as itself
    finally:
        site.close()
    wait_for(lambda: store.get_site(a), what="site a's own heartbeat")
    wait_for(lambda: transitions, what="site.online of a")
    assert store.get_site(b) is None and store.known_sites() == [a]
    assert store.get_job_heartbeat("j", b) is None and store.get_job_heartbeat("j", a) is None
    assert summary(transitions) == [(Names.SITE_ONLINE, a)]


def test_unsigned_or_forged_events_are_refused(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore, transitions: Events,
) -> None:
    start_intake(IntakeConfig(site_ttl_s=30))
    site_publisher.publish("site.x.heartbeat", beat("x"), user_id=None)
    site_publisher.publish("site.x.heartbeat", beat("x"), user_id="y")
    site_publisher.as_site("z", "heartbeat", beat("z"))
    wait_for(lambda: store.get_site("z"), what="z's heartbeat")
    assert store.known_sites() == ["z"]


def test_expired_site_is_announced_offline_exactly_once_with_two_replicas(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore, transitions: Events,
) -> None:
    config = IntakeConfig(site_ttl_s=0.5, sweep_interval_s=0.1)
    start_intake(config)
    start_intake(config)
    site_publisher.as_site("site-1", "heartbeat", beat("site-1"))
    wait_for(lambda: len(transitions) == 2, timeout=10, what="online then offline")
    assert summary(transitions) == [(Names.SITE_ONLINE, "site-1"), (Names.SITE_OFFLINE, "site-1")]
    assert transitions[1][1].running_job_ids == ["job-1"]  # the last known heartbeat
    assert intake.sweep(store) == []  # nothing left for any replica to announce
    site_publisher.as_site("site-2", "heartbeat", beat("site-2"))
    wait_for(lambda: len(transitions) == 4, timeout=10, what="site-2 online and offline")
    assert summary(transitions)[2:] == [(Names.SITE_ONLINE, "site-2"),
                                        (Names.SITE_OFFLINE, "site-2")]


def test_goodbye_is_announced_offline(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore, transitions: Events,
) -> None:
    start_intake(IntakeConfig(site_ttl_s=30))
    sent = now_ms()
    site_publisher.as_site("site-1", "online", beat("site-1", sent))
    site_publisher.as_site("site-1", "offline", beat("site-1", sent + 1))
    wait_for(lambda: len(transitions) == 2, what="online then offline")
    assert summary(transitions) == [(Names.SITE_ONLINE, "site-1"), (Names.SITE_OFFLINE, "site-1")]
    assert store.get_site("site-1") is None and store.known_sites() == ["site-1"]


def test_a_restarted_intake_does_not_repeat_transitions(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore, transitions: Events,
) -> None:
    first = start_intake(IntakeConfig(site_ttl_s=30))
    sent = now_ms()
    site_publisher.as_site("site-1", "heartbeat", beat("site-1", sent))
    wait_for(lambda: transitions, what="site.online")
    first.close()
    start_intake(IntakeConfig(site_ttl_s=30))
    site_publisher.as_site("site-1", "heartbeat", beat("site-1", sent + 1))
    wait_for(lambda: stored_at(store, "site-1") == sent + 1, what="the second heartbeat")
    site_publisher.as_site("site-1", "offline", beat("site-1", sent + 2))
    wait_for(lambda: len(transitions) == 2, what="site.offline")
    assert summary(transitions) == [(Names.SITE_ONLINE, "site-1"), (Names.SITE_OFFLINE, "site-1")]


def test_job_heartbeats_are_stored(
    start_intake: Callable[..., HeartbeatIntake], site_publisher: SitePublisher,
    store: RedisStateStore,
) -> None:
    start_intake(IntakeConfig(job_ttl_s=30))
    job = site_pb2.JobHeartbeat(job_id="job-1", site="site-1", current_task="train",
                                progress=0.5, sent_at_ms=now_ms())
    site_publisher.as_site("site-1", "job", job)
    kept = wait_for(lambda: store.get_job_heartbeat("job-1", "site-1"), what="job heartbeat")
    assert (kept.current_task, kept.progress) == ("train", 0.5)


def test_job_runner_process_runs_the_intake(
    settings: Settings, site_publisher: SitePublisher, store: RedisStateStore,
    transitions: Events, broker: Broker, tmp_path: Path,
) -> None:
    log_file = tmp_path / "job-runner.log"
    with log_file.open("wb") as out:  # a file, not a pipe: a full pipe would stall the runner
        proc = subprocess.Popen(
            [sys.executable, "-c", "from fedhive_services.job_runner.main import main; main()",
             "--site-ttl", "1", "--sweep-interval", "0.2"],
            env=service_env(settings), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        queue = Names(settings.namespace).events_queue("heartbeats")
        wait_for(lambda: queue in broker.declared()[0], timeout=30, what="the intake's queue")

        def beating() -> bool:
            """A beat, as a site sends them, until one is in: the queue is declared before its
            bindings are made, and a beat published in between is routed nowhere."""
            if not transitions:
                site_publisher.as_site("site-1", "heartbeat", beat("site-1"))
            return bool(transitions)

        try:
            wait_for(beating, timeout=15, interval=0.5, what="online")
            wait_for(lambda: len(transitions) == 2, timeout=15, what="offline")
        except AssertionError as err:
            raise AssertionError(f"{err}: {summary(transitions)}; the runner's log:\n"
                                 f"{log_file.read_text()}") from None
        assert summary(transitions) == [(Names.SITE_ONLINE, "site-1"),
                                        (Names.SITE_OFFLINE, "site-1")]
        assert store.known_sites() == ["site-1"]
    finally:
        stop_process(proc)
    output = log_file.read_text()
    assert proc.returncode == 0, output
    assert '"event": "service.stopped"' in output
