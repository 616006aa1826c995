"""Scheduler decisions with an injected clock, the in-memory state store and fake site/runner
ports: ordering, doubling intervals, CAN_NOT_SCHEDULE, min/mandatory, cancel, max_jobs, no
starvation, pending reasons, fences and aborted jobs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import structlog

from fedhive.errors import StaleFencingToken
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.scheduling import Placement, Scheduler, SchedulerConfig, SiteAnswer, judge
from fedhive.scheduling.policy import resolve_placement, retry_interval_ms
from fedhive.scheduling.scheduler import LEASE
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import Fence
from fedhive.state.memory_store import MemoryStateStore

S = JobStatus


class FakeSites:
    """Each site has `free` GPUs; a check reserves them (token), cancel gives them back."""

    def __init__(self, free: dict[str, int], silent: tuple[str, ...] = ()) -> None:
        self.free = dict(free)
        self.silent = silent
        self.checks: list[tuple[str, dict[str, Any]]] = []
        self.cancelled: list[str] = []
        self._held: dict[str, tuple[str, int]] = {}

    def check(self, job_id: str, requirements: Mapping[str, dict[str, Any]],
              timeout_s: float) -> dict[str, SiteAnswer]:
        self.checks.append((job_id, dict(requirements)))
        answers = {}
        for site, need in requirements.items():
            if site in self.silent:
                continue
            gpus = need.get("gpu", 0)
            if gpus > self.free[site]:
                answers[site] = SiteAnswer(False, reason=f"gpu {gpus} > {self.free[site]} free")
                continue
            token = f"{job_id}@{site}"
            self.free[site] -= gpus
            self._held[token] = (site, gpus)
            answers[site] = SiteAnswer(True, token=token)
        return answers

    def cancel(self, job_id: str, reservations: Mapping[str, str]) -> None:
        for token in reservations.values():
            site, gpus = self._held.pop(token)
            self.free[site] += gpus
            self.cancelled.append(token)


class FakeRunner:
    def __init__(self) -> None:
        self.dispatched: list[tuple[str, int, dict[str, str]]] = []
        self.announced: list[tuple[str, JobStatus]] = []

    def dispatch(self, record: JobRecord, fence_token: int) -> None:
        self.dispatched.append((record.job_id, fence_token, record.reservations))

    def announce(self, record: JobRecord) -> None:
        self.announced.append((record.job_id, record.status))


class Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


class World:
    def __init__(self, free: dict[str, int], config: SchedulerConfig | None = None,
                 silent: tuple[str, ...] = ()) -> None:
        self.state = MemoryStateStore()
        self.sites = FakeSites(free, silent)
        self.runner = FakeRunner()
        self.clock = Clock()
        self.config = config or SchedulerConfig(min_schedule_interval_s=10,
                                                max_schedule_interval_s=40,
                                                max_schedule_count=4)
        self.scheduler = Scheduler(self.config, self.state, self.sites, self.runner,
                                   self.clock, structlog.get_logger())
        self.token = self.state.acquire(LEASE, "me", 60)
        self.online(*free)

    def online(self, *sites: str) -> None:
        self.state.record_heartbeats([SiteHeartbeat(site=s, sent_at_ms=self.clock.ms)
                                      for s in sites], 3600)

    def offline(self, site: str) -> None:
        self.state.mark_offline(SiteHeartbeat(site=site, sent_at_ms=self.clock.ms + 1))

    def submit(self, job_id: str, sites: list[str], gpus: int = 0, **meta: Any) -> None:
        spec = {site: {"gpu": gpus} for site in sites if site != "@ALL"} if gpus else {}
        self.state.create_job(job_id, JobMeta(job_id, spec, {"app": ["server", *sites]}, **meta),
                              Submitter("alice"))

    def run(self) -> tuple[list[str], list[str]]:
        assert self.token is not None
        result = self.scheduler.run_pass(self.token)
        return result.dispatched, result.unschedulable

    def job(self, job_id: str) -> JobRecord:
        return self.state.get_job(job_id)

    def finish(self, job_id: str) -> None:
        self.state.change_status(job_id, S.DISPATCHED, S.RUNNING, "started")
        self.state.change_status(job_id, S.RUNNING, S.FINISHED_COMPLETED, "done")


def test_jobs_dispatch_in_submission_order_up_to_max_jobs() -> None:
    world = World({"site-1": 1, "site-2": 1})
    for job in ("a", "b", "c"):
        world.submit(job, ["site-1", "site-2"])
    assert world.run() == (["a"], [])
    record = world.job("a")
    assert record.status is S.DISPATCHED and record.sites == ["site-1", "site-2"]
    assert record.reservations == {"site-1": "a@site-1", "site-2": "a@site-2"}
    assert world.runner.dispatched == [("a", world.token, record.reservations)]
    assert world.runner.announced == [("a", S.DISPATCHED)]
    waiting = world.job("b").pending_reason
    assert waiting["position"] == 1 and waiting["waiting_for"] == "max_jobs"
    assert "max_jobs 1 reached" in waiting["summary"]
    assert world.job("c").pending_reason["position"] == 2
    assert world.run() == ([], [])  # a still dispatched: nothing moves
    world.finish("a")
    assert world.run() == (["b"], [])
    world.finish("b")
    assert world.run() == (["c"], [])


def test_several_jobs_dispatch_in_one_pass_when_slots_allow() -> None:
    world = World({"site-1": 4}, SchedulerConfig(max_jobs=3))
    for job in ("a", "b", "c", "d"):
        world.submit(job, ["site-1"])
    assert world.run() == (["a", "b", "c"], [])
    assert world.job("d").pending_reason["active_jobs"] == 3


def test_failed_tries_double_the_interval_then_cannot_schedule() -> None:
    world = World({"site-1": 1})
    world.submit("big", ["site-1"], gpus=2)
    assert [retry_interval_ms(world.config, n) for n in (1, 2, 3, 4)] == [
        10_000, 20_000, 40_000, 40_000]
    tries: list[int] = []
    for _ in range(200):  # one pass a second
        _, unschedulable = world.run()
        record = world.job("big")
        if record.schedule_count > len(tries):
            tries.append(world.clock.ms)
        if unschedulable:
            break
        world.clock.advance(1)
    start = tries[0]
    assert [(t - start) // 1000 for t in tries] == [0, 10, 30, 70]
    record = world.job("big")
    assert record.status is S.FINISHED_CANT_SCHEDULE and record.schedule_count == 4
    assert record.status_reason == (
        "exceeded max schedule count 4: not enough sites have enough resources "
        "(ok sites 0 < min sites 1). Details: site-1: gpu 2 > 1 free")
    assert record.pending_reason == {}
    assert world.runner.announced == [("big", S.FINISHED_CANT_SCHEDULE)]


def test_pending_reason_names_the_refusal_and_the_next_try() -> None:
    world = World({"site-1": 1, "site-2": 2})
    world.submit("j", ["site-1", "site-2"], gpus=2)
    world.run()
    reason = world.job("j").pending_reason
    assert reason["waiting_for"] == "resources"
    assert reason["refusals"] == {"site-1": "gpu 2 > 1 free"}
    assert reason["next_try_ms"] == world.clock.ms + 10_000 and reason["schedule_count"] == 1
    assert "said no: site-1: gpu 2 > 1 free" in reason["summary"]
    assert world.sites.cancelled == ["j@site-2"] and world.sites.free["site-2"] == 2
    world.clock.advance(5)  # not due: no new check, the reason stays
    world.run()
    assert len(world.sites.checks) == 1 and world.job("j").pending_reason == reason


def test_a_blocked_job_does_not_starve_the_ones_behind_it() -> None:
    world = World({"site-1": 1})
    world.submit("big", ["site-1"], gpus=2)
    world.submit("small", ["site-1"], gpus=1)
    assert world.run() == (["small"], [])
    assert world.job("big").status is S.SUBMITTED


def test_min_clients_runs_on_the_sites_that_said_yes() -> None:
    world = World({"site-1": 1, "site-2": 0, "site-3": 1})
    world.submit("j", ["site-1", "site-2", "site-3"], gpus=1, min_clients=2)
    assert world.run() == (["j"], [])
    assert world.job("j").sites == ["site-1", "site-3"]


def test_default_min_clients_is_every_named_site_and_silence_is_no() -> None:
    world = World({"site-1": 1, "site-2": 1}, silent=("site-2",))
    world.submit("j", ["site-1", "site-2"], gpus=1)
    world.run()
    reason = world.job("j").pending_reason
    assert reason["refusals"] == {"site-2": "no answer (check timeout)"}
    assert world.sites.cancelled == ["j@site-1"]


def test_mandatory_site_must_say_yes() -> None:
    world = World({"site-1": 1, "site-2": 0})
    world.submit("j", ["site-1", "site-2"], gpus=1, min_clients=1,
                 mandatory_clients=["site-2"])
    world.run()
    assert world.job("j").status is S.SUBMITTED
    assert "mandatory sites site-2" in world.job("j").pending_reason["last_try"]
    assert world.sites.cancelled == ["j@site-1"]


def test_offline_mandatory_site_waits_and_runs_as_soon_as_it_is_online() -> None:
    world = World({"site-1": 1, "site-2": 1})
    world.offline("site-2")
    world.submit("j", ["site-1", "site-2"], min_clients=1, mandatory_clients=["site-2"])
    world.run()
    reason = world.job("j").pending_reason
    assert reason["waiting_for"] == "sites_offline" and reason["offline_sites"] == ["site-2"]
    assert "offline: site-2" in reason["summary"] and world.sites.checks == []
    world.clock.advance(1)
    world.online("site-2")  # before its next schedule time: tried at once
    assert world.run() == (["j"], [])


def test_all_sites_means_the_online_ones_and_needs_one_by_default() -> None:
    placement = resolve_placement(JobMeta("j", deploy_map={"app": ["@ALL"]}), {"b", "a"})
    assert placement == Placement(sites=["a", "b"], required=[], min_sites=1)
    world = World({"site-1": 0, "site-2": 1})
    world.submit("j", ["@ALL"], gpus=0)
    world.state.create_job("k", JobMeta("k", {"site-1": {"gpu": 1}, "site-2": {"gpu": 1}},
                                        {"app": ["@ALL"]}), Submitter("a"))
    assert world.run() == (["j"], [])
    world.finish("j")
    assert world.run() == (["k"], [])
    assert world.job("k").sites == ["site-2"]


def test_judge_counts_and_requires() -> None:
    placement = Placement(sites=["a", "b"], required=["b"], min_sites=1)
    verdict = judge(placement, {"a": SiteAnswer(True, "t"), "b": SiteAnswer(False, reason="x")})
    assert not verdict.runnable and verdict.to_cancel == {"a": "t"}
    ok = judge(placement, {"b": SiteAnswer(True, "u")})
    assert ok.runnable and ok.chosen == ["b"] and ok.refusals == {"a": "no answer (check timeout)"}


def test_aborted_job_is_not_dispatched_and_its_reservations_are_cancelled() -> None:
    world = World({"site-1": 1})
    world.submit("j", ["site-1"], gpus=1)
    original = world.sites.check

    def abort_during_check(job_id: str, requirements: Mapping[str, dict[str, Any]],
                           timeout_s: float) -> dict[str, SiteAnswer]:
        world.state.change_status(job_id, S.SUBMITTED, S.FINISHED_ABORTED, "aborted")
        return original(job_id, requirements, timeout_s)

    world.sites.check = abort_during_check  # type: ignore[method-assign]
    assert world.run() == ([], [])
    assert world.job("j").status is S.FINISHED_ABORTED and world.runner.dispatched == []
    assert world.sites.cancelled == ["j@site-1"] and world.sites.free["site-1"] == 1


def test_deposed_leader_changes_nothing() -> None:
    world = World({"site-1": 1})
    world.submit("j", ["site-1"], gpus=1)
    assert world.token is not None
    world.state.release(LEASE, "me", world.token)
    assert world.state.acquire(LEASE, "other", 60) == world.token + 1
    result = world.scheduler.run_pass(world.token)
    assert result.deposed and result.dispatched == []
    assert world.job("j").status is S.SUBMITTED and world.runner.dispatched == []
    assert world.sites.cancelled == ["j@site-1"]
    with pytest.raises(StaleFencingToken):
        world.state.change_status("j", S.SUBMITTED, S.DISPATCHED, "x",
                                  fence=Fence(
                                      LEASE, world.token))


def test_config_is_validated() -> None:
    with pytest.raises(Exception, match="max_jobs"):
        SchedulerConfig(max_jobs=0)
    with pytest.raises(Exception, match="max_schedule_interval_s"):
        SchedulerConfig(min_schedule_interval_s=10, max_schedule_interval_s=5)
