"""The monitor thread: watches the jobs this runner owns in the running-jobs table.

Every `monitor_interval_s`, for each running job: renew its ownership lease; end it when its
server job reported (`COMPLETED` / `EXECUTION_EXCEPTION`), ended or lost its liveness without
reporting (`ABNORMAL`, with the exit code or signal), or ran past its `max_runtime` (`ABORTED`);
tell the server job about sites that are gone (`liveness.judge`: its client job ended, or is no
longer listed by its site; the site went offline, or stopped reporting the job, judged only
while this process's heartbeat intake trusts its view for a whole TTL), so that the workflow's
minimums decide between carrying on and failing. Across all sites: a site running a job that is
over (or unknown) is told to abort it. A tick does nothing while the process is not sure it
holds its runner id (`identity`).

At start (`recover`), jobs a previous runner with the same id left in the table are taken
back, their ownership leases taken over with new tokens (the predecessor is gone: this process
holds the id), so a write it still had in flight is refused. RUNNING ones are simply watched
again (their server jobs never depended on the runner), DISPATCHED ones (it was still deploying
or starting them) are dispatched again, resuming from where it stopped (`dispatch.py`).
At start and every `orphan_grace_s`, a DISPATCHED job that no runner works on (its ownership
lease is free or expired, or held under this runner's id with no dispatch of it in progress
here) for longer than `orphan_grace_s` — its `DispatchJob` was lost, or its runner died
mid-dispatch — is re-issued to the runners' queue from its record; and a job whose runner is
gone for good (no live process holds its runner id, and the job's ownership lease lapsed: a
runner whose host died, whose replacement has another id) is taken over as at `recover` (its
server job, wherever it runs, is then judged by its liveness record: `server_job`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from fedhive.errors import FedhiveError, NotFound
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import runner_pb2, site_pb2
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state.runs import RunEntry

from . import identity, server_job
from .context import RunnerContext, lease_name
from .finish import conclude, record_sites, wind_up
from .heartbeats import STORE_ERRORS, HeartbeatIntake
from .liveness import View, judge, only_beats_moved

R = JobStatus.RUNNING
SERVICE = "job-runner"  # the runners' queue, where dispatches are re-issued
LIVENESS_GRACE_S = 10.0  # a server job must have written its first liveness record by then
ABORT_RESEND_S = 10.0  # how often a site still running a finished job is told again
# A job's sites' last heartbeats (shown by `fedhive job`, read by no verdict) are written with any
# other change at once, alone at most this often: at 300 sites beating every 5 s, each 0.5 s
# tick saw ~30 new beats and rewrote the job's whole run entry and record.
LAST_BEATS_WRITE_S = 5.0


def max_runtime(record: JobRecord) -> float | None:
    """`max_runtime` of meta.json (seconds); None when absent or not a positive number."""
    value = record.meta.extra.get("max_runtime")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def recover(ctx: RunnerContext) -> None:
    for entry in ctx.runs.all():
        if entry.runner == ctx.config.holder:
            take_back(ctx, entry, "the job-runner restarted")


def take_back(ctx: RunnerContext, entry: RunEntry, why: str) -> None:
    """Own the job `entry`'s runner left: its ownership lease taken over with a new token (so a
    write of the one before, still in flight, is refused), then the job's status decides."""
    token = ctx.state.take_over(lease_name(entry.job_id), ctx.config.holder,
                                ctx.config.lease_ttl_s, previous=entry.runner)
    if token is None:
        return  # another runner took the job over meanwhile
    entry = replace(entry, runner=ctx.config.holder, fence_token=token)
    ctx.runs.put(entry)
    status = ctx.state.get_job(entry.job_id).status
    if status == R:  # the phase may lag the status by one write: the status decides
        ctx.runs.put(replace(entry, phase="running"))
        ctx.log.info("job_runner.reattached", job_id=entry.job_id, pid=entry.pid,
                     host=entry.host, why=why)
    elif status == JobStatus.DISPATCHED:
        redispatch(ctx, entry.job_id, f"{why} while it was {entry.phase}")
    else:
        wind_up(ctx, entry, f"job is {status.value}")


def abandoned(ctx: RunnerContext) -> list[RunEntry]:
    """Jobs of other runner ids whose runner is gone: no process holds the id, and the job's
    ownership lease lapsed (so its runner stopped renewing it)."""
    return [entry for entry in ctx.runs.all()
            if entry.runner != ctx.config.holder
            and ctx.state.get_lease(identity.lease_name(entry.runner)) is None
            and ctx.state.get_lease(lease_name(entry.job_id)) is None]


def redispatch(ctx: RunnerContext, job_id: str, why: str) -> None:
    """Re-issue a job's `DispatchJob` (without sites: the handler reads them from the record)
    to the runners' queue, where any runner may take it up."""
    ctx.log.warning("job_runner.redispatch", job_id=job_id, why=why)
    ctx.bus.send(ctx.names.service_queue(SERVICE), runner_pb2.DispatchJob(job_id=job_id))


def orphans(ctx: RunnerContext) -> list[str]:
    """DISPATCHED jobs no runner works on, for longer than `orphan_grace_s`."""
    found = []
    now_ms = time.time() * 1000
    for record in ctx.state.list_jobs(JobStatus.DISPATCHED):
        since = record.history[-1].at_ms if record.history else record.submit_time_ms
        if now_ms - since < ctx.config.orphan_grace_s * 1000:
            continue
        lease = ctx.state.get_lease(lease_name(record.job_id))
        if lease is not None and lease.holder != ctx.config.holder:
            continue
        with ctx.try_job_lock(record.job_id) as free:
            if free:
                found.append(record.job_id)
    return found


class Monitor:
    def __init__(self, ctx: RunnerContext, heartbeats: HeartbeatIntake) -> None:
        self.ctx = ctx
        self.heartbeats = heartbeats
        self._paused = False  # what the loop last logged about `ctx.owner`
        self._stop = threading.Event()
        self._told: dict[tuple[str, str], float] = {}
        self._reissued: dict[str, float] = {}
        self._beats_written: dict[str, float] = {}  # job -> when its site states were written
        self._next_scan = 0.0
        self._thread = threading.Thread(target=self._loop, name="job-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.ctx.config.monitor_interval_s):
            if not self._owner():
                continue
            try:
                self.tick()
            except Exception as err:  # Redis or the broker away: the next tick tries again
                if isinstance(err, STORE_ERRORS):
                    self.heartbeats.vigil.store_failed()
                self.ctx.log.warning("job_runner.monitor_failed", error=str(err))
            else:
                self.heartbeats.vigil.store_answered()

    def _owner(self) -> bool:
        held = self.ctx.owner.held()
        if held and self._paused:
            self.ctx.log.info("job_runner.monitor_resumed")
        elif not held and not self._paused:
            self.ctx.log.warning("job_runner.monitor_paused",
                                 why="not sure this process still holds its runner id")
        self._paused = not held
        return held

    def tick(self) -> None:
        running = set()
        online = set(self.ctx.state.online_sites())
        live = {beat.site: beat for beat in self.ctx.state.live_sites()}
        for entry in self.ctx.runs.all():
            running.add(entry.job_id)
            if entry.runner != self.ctx.config.holder:
                continue
            if entry.phase != "running":  # a dispatch in progress: keep its ownership
                self._renew(entry)
            with self.ctx.try_job_lock(entry.job_id) as free:
                current = self.ctx.runs.get(entry.job_id) if free else None
                if current is not None and current.phase != "running":
                    current = self._caught_up(current)
                if current is not None:
                    self.watch(current, online, live)
        for job_id in self._beats_written.keys() - running:
            del self._beats_written[job_id]
        self.stray_jobs(running, live)
        if time.monotonic() >= self._next_scan:
            self.reissue_orphans()

    def _caught_up(self, entry: RunEntry) -> RunEntry | None:
        """An entry no dispatch works on any more (this runner's job lock is free) that is not
        in phase running: the job's status decides, as at `recover`. RUNNING: the dispatch set
        the status, then failed before it recorded the phase (Redis or the broker away at that
        moment), so the job is watched from now on; anything else is the orphan scan's."""
        if self.ctx.state.get_job(entry.job_id).status != R:
            return None
        self.ctx.log.warning("job_runner.phase_caught_up", job_id=entry.job_id, was=entry.phase,
                             why="the job is RUNNING; its dispatch stopped before recording it")
        caught_up = replace(entry, phase="running")
        self.ctx.runs.put(caught_up)
        return caught_up

    def _renew(self, entry: RunEntry) -> None:
        try:
            self.ctx.state.renew(lease_name(entry.job_id), self.ctx.config.holder,
                                 entry.fence_token, self.ctx.config.lease_ttl_s)
        except FedhiveError as err:
            self.ctx.log.warning("job_runner.lease_lost", job_id=entry.job_id, error=str(err))

    def reissue_orphans(self) -> None:
        """Re-issue lost or interrupted dispatches (one job at most once per dispatch time)."""
        now = time.monotonic()
        self._next_scan = now + self.ctx.config.orphan_grace_s
        again_after = self.ctx.config.orphan_grace_s + 3 * self.ctx.config.sync_timeout_s
        for job_id in orphans(self.ctx):
            if now - self._reissued.get(job_id, -1e9) >= again_after:
                self._reissued[job_id] = now
                redispatch(self.ctx, job_id, "DISPATCHED, and no job-runner works on it")
        for entry in abandoned(self.ctx):
            self.ctx.log.warning("job_runner.taking_over", job_id=entry.job_id,
                                 runner=entry.runner, why="its job-runner is gone")
            take_back(self.ctx, entry, f"job-runner {entry.runner!r} is gone")

    # one job ----------------------------------------------------------------------------
    def watch(self, entry: RunEntry, online: set[str], live: dict[str, SiteHeartbeat]) -> None:
        ctx = self.ctx
        ctx.state.renew(lease_name(entry.job_id), ctx.config.holder, entry.fence_token,
                        ctx.config.lease_ttl_s)
        record = ctx.state.get_job(entry.job_id)
        if record.status != R:  # ended elsewhere (an abort): only the cleanup is left
            wind_up(ctx, entry, f"job is {record.status.value}")
            return
        outcome = ctx.runs.outcome(entry.job_id)
        if outcome is not None:
            if outcome.completed:
                conclude(ctx, entry, R, JobStatus.FINISHED_COMPLETED, "server job completed")
            else:
                conclude(ctx, entry, R, JobStatus.FINISHED_EXECUTION_EXCEPTION, outcome.error)
            return
        how = server_job.ended(ctx, entry)
        if how is None and not ctx.runs.alive(entry.job_id) \
                and time.time() - entry.pid_started > LIVENESS_GRACE_S:
            how = "server job lost its liveness record"
        if how is not None:
            if ctx.runs.outcome(entry.job_id) is None:  # it may have reported just now
                conclude(ctx, entry, R, JobStatus.FINISHED_ABNORMAL,
                         f"server job ended without reporting: {how}")
            return
        limit = max_runtime(record)
        if limit is not None and record.start_time_ms is not None \
                and time.time() * 1000 - record.start_time_ms > limit * 1000:
            conclude(ctx, entry, R, JobStatus.FINISHED_ABORTED,
                     f"max_runtime {limit:g} s exceeded")
            return
        self.gone_sites(entry, online, live)

    def gone_sites(self, entry: RunEntry, online: set[str],
                   live: dict[str, SiteHeartbeat]) -> None:
        """Judge each started site (`liveness.judge`); tell the server job of each gone one.
        A site is recorded gone only once the server job was told, so a notice the broker
        refused is sent again on the next tick."""
        ctx, config = self.ctx, self.heartbeats.config
        trust_sites = self.heartbeats.trusts(config.site_ttl_s)
        trust_jobs = self.heartbeats.trusts(config.job_ttl_s)
        before = entry
        judged = [site for site, state in sorted(entry.sites.items())
                  if state.started and not (state.excluded or state.gone or state.ended)]
        job_beats = ctx.state.get_job_heartbeats(entry.job_id, judged)
        for site in judged:
            state = entry.sites[site]
            view = View(online=site in online, site_beat=live.get(site),
                        job_beat=job_beats.get(site),
                        trust_sites=trust_sites, trust_jobs=trust_jobs)
            updated, why = judge(entry.job_id, state, view)
            if why:
                ctx.log.warning("job_runner.site_gone", job_id=entry.job_id, site=site, why=why)
                if not self._tell_server_job(entry.job_id, site, why):
                    continue
                updated = replace(updated, gone=why)
            elif updated.ended:
                ctx.log.info("job_runner.client_job_ended", job_id=entry.job_id, site=site,
                             how=updated.ended)
            entry = replace(entry, sites={**entry.sites, site: updated})
        now = time.monotonic()
        if entry != before and (not only_beats_moved(before, entry)
                                or now >= self._beats_written.get(entry.job_id, 0.0)
                                + LAST_BEATS_WRITE_S):
            ctx.runs.put(entry)
            record_sites(ctx, entry)
            self._beats_written[entry.job_id] = now

    def _tell_server_job(self, job_id: str, site: str, why: str) -> bool:
        try:
            self.ctx.bus.send(self.ctx.names.job_server_queue(job_id),
                              runner_pb2.SiteGone(job_id=job_id, site=site, reason=why))
        except FedhiveError as err:
            self.ctx.log.warning("job_runner.site_gone_not_sent", job_id=job_id, site=site,
                                 error=str(err))
            return False
        return True

    # every site -------------------------------------------------------------------------
    def stray_jobs(self, running: set[str], live: dict[str, SiteHeartbeat]) -> None:
        """A site running a job that is over, or that fedhive never had, is told to abort."""
        now = time.monotonic()
        for beat in live.values():
            for job_id in beat.running_job_ids:
                if job_id in running or now - self._told.get((beat.site, job_id), -1e9) \
                        < ABORT_RESEND_S:
                    continue
                try:
                    status = self.ctx.state.get_job(job_id).status.value
                except NotFound:
                    status = "unknown"
                if status not in ("unknown",) and not JobStatus(status).is_final:
                    continue
                self._told[(beat.site, job_id)] = now
                self.ctx.log.warning("job_runner.stray_job", site=beat.site, job_id=job_id,
                                     status=status)
                self.ctx.bus.send(self.ctx.names.site_queue(beat.site), site_pb2.AbortRequest(
                    job_id=job_id, reason=f"the job is {status} on the server"))
