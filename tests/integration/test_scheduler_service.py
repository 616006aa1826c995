"""The fedhive-scheduler process against real RabbitMQ, Redis and site agents.

Sites are marked online in the real registry (`record_heartbeats`, what the heartbeat intake
does) so the test needs no per-site broker users; check_resources goes to the real agents. The
job-runner's part is played by the test: it consumes the DispatchJob commands from
`{ns}.job-runner` and moves jobs on with the state CAS.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fedhive.bus import Delivery, RabbitBus
from fedhive.config import Settings
from fedhive.jobs.record import JobMeta, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import runner_pb2
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import RedisStateStore
from tests.fixtures.infra import wait_for
from tests.fixtures.scheduler import ONE_GPU

S = JobStatus
FAST = ("--min-schedule-interval", "0.2", "--max-schedule-interval", "0.4",
        "--check-timeout", "5")


@pytest.fixture
def state(bus_settings: Settings) -> Iterator[RedisStateStore]:
    store = RedisStateStore.from_settings(bus_settings)
    yield store
    store.close()


class RunnerQueue:
    """Plays the job-runner's queue: records every DispatchJob."""

    def __init__(self, bus: RabbitBus, names: Names) -> None:
        self.commands: list[runner_pb2.DispatchJob] = []
        self._lock = threading.Lock()
        bus.serve(names.service_queue("job-runner"), self._on, [runner_pb2.DispatchJob])

    def _on(self, message: Any, delivery: Delivery) -> None:
        with self._lock:
            self.commands.append(message)

    def job_ids(self) -> list[str]:
        with self._lock:
            return [c.job_id for c in self.commands]


def online(state: RedisStateStore, *sites: str) -> None:
    state.record_heartbeats([SiteHeartbeat(site=s, sent_at_ms=time.time_ns() // 10**6)
                             for s in sites], 600)


def submit(state: RedisStateStore, job_id: str, sites: list[str], gpus: int = 0,
           **meta: Any) -> None:
    spec = {site: {"gpu": gpus} for site in sites} if gpus else {}
    state.create_job(job_id, JobMeta(job_id, spec, {"app": ["server", *sites]}, **meta),
                     Submitter("alice"))


def finish(state: RedisStateStore, job_id: str) -> None:
    state.change_status(job_id, S.DISPATCHED, S.RUNNING, "started")
    state.change_status(job_id, S.RUNNING, S.FINISHED_COMPLETED, "done")


def test_job_needing_more_than_sites_have_ends_cannot_schedule(
    site_agents: Any, state: RedisStateStore,
    scheduler_processes: Callable[..., Any],
) -> None:
    site_agents.start("site-1", resources=ONE_GPU)
    online(state, "site-1")
    scheduler_processes("--max-schedule-count", "3", *FAST)
    submit(state, "big", ["site-1"], gpus=2)
    record = wait_for(lambda: (r := state.get_job("big")).status.is_final and r, timeout=30,
                      what="job to end")
    assert record.status is S.FINISHED_CANT_SCHEDULE and record.schedule_count == 3
    assert "site-1: gpu 2 > 1 on this site" in record.status_reason


def test_dispatch_max_jobs_pending_reasons_and_leader_failover(
    site_agents: Any, state: RedisStateStore, make_bus: Callable[..., RabbitBus],
    bus_settings: Settings, scheduler_processes: Callable[..., Any],
) -> None:
    for site in ("site-1", "site-2"):
        site_agents.start(site, resources=ONE_GPU)
    online(state, "site-1")  # site-2 is offline for now
    runner = RunnerQueue(make_bus(name="runner-double"), Names(bus_settings.namespace))
    first = scheduler_processes("--max-jobs", "1", *FAST)
    scheduler_processes("--max-jobs", "1", *FAST)
    submit(state, "needs-2", ["site-1", "site-2"], gpus=1, mandatory_clients=["site-2"])
    submit(state, "a", ["site-1"], gpus=1)
    submit(state, "b", ["site-1"], gpus=1)
    wait_for(lambda: runner.job_ids() == ["a"], timeout=20, what="a dispatched")
    record = state.get_job("a")
    assert record.status is S.DISPATCHED and record.sites == ["site-1"]
    assert runner.commands[0].sites[0].token == record.reservations["site-1"]
    lease = state.get_lease("scheduler")
    assert lease is not None and runner.commands[0].fence_token == lease.token
    waiting = wait_for(lambda: state.get_job("b").pending_reason.get("waiting_for") == "max_jobs"
                       and state.get_job("b").pending_reason, timeout=10, what="b's reason")
    assert waiting["position"] == 2 and "max_jobs 1 reached" in waiting["summary"]
    blocked = state.get_job("needs-2").pending_reason
    assert blocked["offline_sites"] == ["site-2"]

    leader = first if str(first.pid) in lease.holder else None
    assert leader is not None, lease.holder
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    finish(state, "a")  # frees the max_jobs slot; site-1's GPU was reserved by a: free it
    site_agents.started[0].stop()
    site_agents.started[0].launch()
    wait_for(lambda: "b" in runner.job_ids(), timeout=20, what="the new leader dispatches b")
    new_lease = state.get_lease("scheduler")
    assert new_lease is not None and new_lease.token > lease.token
    finish(state, "b")
    site_agents.started[0].stop()
    site_agents.started[0].launch()
    online(state, "site-2")
    wait_for(lambda: "needs-2" in runner.job_ids(), timeout=20,
             what="needs-2 dispatched once site-2 is online")
    assert state.get_job("needs-2").sites == ["site-1", "site-2"]
