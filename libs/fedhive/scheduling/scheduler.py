"""One scheduling pass: SUBMITTED jobs in submission order, tried when due, dispatched while
fewer than `max_jobs` are DISPATCHED or RUNNING.

Every write is conditional: status changes are compare-and-set, other fields are written only
while the job is still SUBMITTED, and all of them carry the leader's fence, so a job aborted
meanwhile is never dispatched and a deposed leader changes nothing. A job that cannot run does
not stop the scan: later jobs that can run are dispatched in the same pass (no starvation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedhive.errors import IllegalTransition, NotFound, StaleFencingToken
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from fedhive.scheduling import reasons
from fedhive.scheduling.policy import (
    SchedulerConfig,
    is_due,
    requirement_for,
    resolve_placement,
    retry_interval_ms,
)
from fedhive.scheduling.verdict import SiteAnswer, Verdict, judge
from fedhive.state.port import Fence, JobStore, JobUpdate

LEASE = "scheduler"  # the leader lease; its fencing token guards every write


class SchedulingState(JobStore, Protocol):
    def online_sites(self) -> list[str]: ...


class SiteResources(Protocol):
    def check(
        self, job_id: str, requirements: Mapping[str, dict[str, Any]], timeout_s: float
    ) -> dict[str, SiteAnswer]:
        """Ask every site at once; a site that does not answer within the timeout is absent."""
        ...

    def cancel(self, job_id: str, reservations: Mapping[str, str]) -> None:
        """Give reservations back (best effort: unanswered ones expire on the site)."""
        ...


class RunnerLink(Protocol):
    def dispatch(self, record: JobRecord, fence_token: int) -> None:
        """Send the durable DispatchJob for a job just moved to DISPATCHED."""
        ...

    def announce(self, record: JobRecord) -> None:
        """Publish the record's latest status change as `job.status.<STATUS>`."""
        ...


@dataclass
class PassResult:
    dispatched: list[str] = field(default_factory=list)
    unschedulable: list[str] = field(default_factory=list)
    deposed: bool = False  # the fence was stale: this replica is not the leader any more


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        state: SchedulingState,
        sites: SiteResources,
        runner: RunnerLink,
        clock_ms: Callable[[], int],
        log: Any,
    ) -> None:
        self.config = config
        self._state = state
        self._sites = sites
        self._runner = runner
        self._clock_ms = clock_ms
        self._log = log

    def run_pass(self, fence_token: int) -> PassResult:
        fence = Fence(LEASE, fence_token)
        result = PassResult()
        waiting = self._state.list_jobs(JobStatus.SUBMITTED)
        active = sum(len(self._state.list_jobs(s))
                     for s in (JobStatus.DISPATCHED, JobStatus.RUNNING))
        online = set(self._state.online_sites())
        position = 0
        try:
            for record in waiting:
                now = self._clock_ms()
                position += 1
                if active >= self.config.max_jobs:
                    self._note(record, reasons.slots_full(
                        record, position, active, self.config.max_jobs,
                        self.config.max_schedule_count), fence)
                elif not is_due(record, now, online):
                    self._note(record, reasons.not_due(
                        record, position, self.config.max_schedule_count), fence)
                elif self._try(record, position, now, online, fence, result):
                    active += 1
                    position -= 1
        except StaleFencingToken as err:
            self._log.warning("scheduler.deposed", error=str(err))
            result.deposed = True
        return result

    def _note(self, record: JobRecord, reason: dict[str, Any], fence: Fence) -> None:
        """Keep the job's pending reason current (written only when it changed)."""
        if reason != record.pending_reason:
            self._update(record, JobUpdate(pending_reason=reason), fence)

    def _update(self, record: JobRecord, update: JobUpdate, fence: Fence) -> None:
        try:
            self._state.update_job(record.job_id, update, fence=fence,
                                   expected=JobStatus.SUBMITTED)
        except (IllegalTransition, NotFound) as err:  # aborted or deleted meanwhile
            self._log.info("scheduler.job_moved_on", job_id=record.job_id, error=str(err))

    def _try(self, record: JobRecord, position: int, now: int, online: set[str], fence: Fence,
             result: PassResult) -> bool:
        """Try the job once; True when it was dispatched."""
        placement = resolve_placement(record.meta, online)
        blocker = placement.blocker
        if blocker is not None:
            self._failed(record, position, now, fence, result, offline=placement.offline,
                         refusals={}, why=blocker)
            return False
        requirements = {site: requirement_for(record.meta, site) for site in placement.sites}
        answers = self._sites.check(record.job_id, requirements, self.config.check_timeout_s)
        verdict = judge(placement, answers)
        if not verdict.runnable:
            self._sites.cancel(record.job_id, verdict.to_cancel)
            self._failed(record, position, now, fence, result, offline=placement.offline,
                         refusals=verdict.refusals, why=verdict.reason)
            return False
        return self._dispatch(record, verdict, now, fence, result)

    def _dispatch(self, record: JobRecord, verdict: Verdict, now: int, fence: Fence,
                  result: PassResult) -> bool:
        update = JobUpdate(schedule_count=record.schedule_count + 1, last_schedule_time_ms=now,
                           pending_reason={}, sites=verdict.chosen,
                           reservations=verdict.reservations)
        reason = f"scheduled on {', '.join(verdict.chosen)}"
        try:
            dispatched = self._state.change_status(
                record.job_id, JobStatus.SUBMITTED, JobStatus.DISPATCHED, reason,
                update=update, fence=fence)
        except (IllegalTransition, NotFound, StaleFencingToken) as err:
            self._sites.cancel(record.job_id, verdict.reservations)
            if isinstance(err, StaleFencingToken):
                raise
            self._log.info("scheduler.job_moved_on", job_id=record.job_id, error=str(err))
            return False
        self._runner.dispatch(dispatched, fence.token)
        self._runner.announce(dispatched)
        self._log.info("scheduler.dispatched", job_id=record.job_id, sites=verdict.chosen)
        result.dispatched.append(record.job_id)
        return True

    def _failed(self, record: JobRecord, position: int, now: int, fence: Fence,
                result: PassResult, *, offline: list[str], refusals: dict[str, str],
                why: str) -> None:
        count = record.schedule_count + 1
        bound = self._log.bind(job_id=record.job_id, schedule_count=count)
        if count >= self.config.max_schedule_count:
            reason = f"exceeded max schedule count {self.config.max_schedule_count}: {why}"
            update = JobUpdate(schedule_count=count, last_schedule_time_ms=now,
                               next_schedule_time_ms=None, pending_reason={})
            try:
                final = self._state.change_status(
                    record.job_id, JobStatus.SUBMITTED, JobStatus.FINISHED_CANT_SCHEDULE,
                    reason, update=update, fence=fence)
            except (IllegalTransition, NotFound) as err:
                bound.info("scheduler.job_moved_on", error=str(err))
                return
            self._runner.announce(final)
            bound.warning("scheduler.cannot_schedule", reason=reason)
            result.unschedulable.append(record.job_id)
            return
        next_try = now + retry_interval_ms(self.config, count)
        pending = reasons.failed_try(position, count, self.config.max_schedule_count,
                                     offline=offline, refusals=refusals, last_try=why,
                                     next_try_ms=next_try)
        self._update(record, JobUpdate(schedule_count=count, last_schedule_time_ms=now,
                                       next_schedule_time_ms=next_try, pending_reason=pending),
                     fence)
        bound.info("scheduler.not_runnable", reason=why, next_try_ms=next_try)
