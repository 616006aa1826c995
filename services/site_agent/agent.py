"""One site's jobs: resources, deployed bundles and client-job processes. No transport here:
`handlers` translates the control queue's protobuf to these calls.

Every command is idempotent (a redelivered one returns the job as it is now) and runs under its
job's lock, so two deliveries of the same command never overlap. Each change of a job is saved
to its record file before the command returns (see `records`).

When a client job's process ends, however it ends, its record gets the exit code, why it ended
(its last words, else what its exit status and log tell) and a pending notice; `notice_due` is
set, and `heartbeat.EndedNotices` publishes the notice until the broker confirmed it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from fedhive.config import child_environment
from fedhive.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from fedhive.jobs.archive import UnsafeArchive
from fedhive.jobs.validation import APP_NAME
from fedhive.names import Names
from fedhive.resources import CheckResult, SiteResources

from . import bundle, process
from .config import SiteConfig
from .hub_config import ENDED_MARK
from .launch import Launcher, Processes, Running
from .records import (
    JobRecord,
    JobState,
    LastWords,
    Workspace,
    check_job_id,
    now_ms,
    one_line,
)

if TYPE_CHECKING:
    from .hub import Hub

log = structlog.get_logger()

GONE = "client job was gone when the site agent restarted"
NOT_RESTORED = "client job stopped: the restarted site agent could not take its resources again"
ADOPTED_POLL_S = 0.5  # how often the liveness of a re-adopted client job is checked

Downloader = Callable[[str, str, int], bytes]  # (url, what, limit) -> body


def _download(url: str, what: str, limit: int) -> bytes:
    body: bytes = bundle.download(url, what=what, limit=limit)
    return body


def _abort_unfinished(record: JobRecord) -> bool:
    """An ABORTED job whose client job was started but whose end was never recorded."""
    return (record.state is JobState.ABORTED and record.pid > 0 and record.exit_code is None
            and not record.exit_reason)


class SiteAgent:
    def __init__(
        self,
        config: SiteConfig,
        resources: SiteResources,
        workspace: Workspace,
        *,
        downloader: Downloader = _download,
        hub: Hub | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.config = config
        self.hub = hub  # a hub site's lower tier (`hub`), None for an ordinary site
        self._manager = resources.manager
        self._consumer = resources.consumer
        self._ws = workspace
        self._download = downloader
        self._launcher = launcher or Processes()
        self._lock = threading.Lock()
        self._job_locks: dict[str, threading.Lock] = {}
        self._records: dict[str, JobRecord] = {}
        self._procs: dict[str, Running] = {}  # the client jobs this agent started
        self._watchers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.notice_due = threading.Event()  # set when a job's ended notice became pending
        self._log = log.bind(site=config.site)

    # -- lifecycle ------------------------------------------------------------------------------
    def reconcile(self) -> list[JobRecord]:
        """At start, from the records an earlier agent left. A RUNNING job whose client job
        still lives (same pid and start time) is re-adopted: it stays RUNNING, its resources are
        taken again under its token and a watcher waits for its end. One whose client job is
        gone becomes LOST, and so does one whose resources cannot be taken again (its client job
        is stopped: its GPUs could be handed out twice). An abort the earlier agent did not see
        through is finished. Other jobs' allocations died with the earlier agent's resource
        manager. Returns the records it changed."""
        self._ws.create()
        changed = []
        adopted = []
        for record in self._ws.load_jobs():
            updated = record
            if record.state is JobState.RUNNING:
                updated = self._recover(record)
                if updated is record:
                    adopted.append(record)
            elif _abort_unfinished(record):  # the earlier agent died during the abort
                process.stop_group(record.pid, record.pid_started, self.config.abort_grace_s)
                updated = self._with_end(record.but(token="", allocation=None), None)
            elif record.allocation is not None:
                updated = record.but(token="", allocation=None)
            if updated is not record:
                self._ws.save_job(updated)
                changed.append(updated)
                self._log.warning("site_agent.reconciled", job_id=record.job_id,
                                  was=record.state.value, now=updated.state.value,
                                  reason=updated.reason, exit_reason=updated.exit_reason)
            self._records[record.job_id] = updated
        for record in adopted:
            self._log.info("site_agent.readopted", job_id=record.job_id, pid=record.pid,
                           resources=record.allocation)
            self._watch_in_thread(record.job_id, partial(self._watch_adopted, record))
        if any(r.notice_pending for r in self._records.values()):
            self.notice_due.set()
        return changed

    def shutdown(self) -> None:
        """Clean shutdown: abort running client jobs (none may outlive its agent), wait for
        their ends to be recorded."""
        for job_id in self.running_job_ids():
            self.abort(job_id, "the site agent shut down")
        with self._lock:
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher.join(timeout=self.config.abort_grace_s + 5)
        self._stopping.set()

    # -- queries --------------------------------------------------------------------------------
    def jobs(self) -> list[JobRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.job_id)

    def running_job_ids(self) -> list[str]:
        return [r.job_id for r in self.jobs() if r.state is JobState.RUNNING]

    def report_resources(self) -> dict[str, Any]:
        return self._manager.report_resources()

    def pending_notices(self) -> list[JobRecord]:
        """Jobs whose ended notice the broker has not confirmed yet."""
        return [r for r in self.jobs() if r.notice_pending]

    def notice_published(self, job_id: str) -> None:
        with self._job(job_id):
            record = self._get(job_id)
            if record is not None and record.notice_pending:
                self._save(record.but(notice_pending=False))

    # -- resources ------------------------------------------------------------------------------
    def check_resources(self, job_id: str, requirement: Mapping[str, Any]) -> CheckResult:
        check_job_id(job_id)
        if self.hub is not None and not (below := self.hub.check()).ok:
            self._log.info("site_agent.checked", job_id=job_id, ok=False, reason=below.reason)
            return below
        result = self._manager.check_resources(requirement)
        self._log.info("site_agent.checked", job_id=job_id, ok=result.ok, reason=result.reason)
        return result

    def cancel_resources(self, token: str) -> bool:
        return self._manager.cancel_resources(token)

    def allocate(self, job_id: str, token: str) -> JobRecord:
        with self._job(check_job_id(job_id)):
            record = self._get(job_id)
            if record is not None and record.allocation is not None:
                if record.token == token:
                    return record  # a redelivered allocate
                raise AlreadyExists(
                    f"job {job_id} already holds resources on site {self.config.site}",
                    field="job_id",
                )
            if record is not None and record.state.final:
                raise FailedPrecondition(
                    f"job {job_id} is {record.state.value} on site {self.config.site}",
                    field="job_id",
                )
            allocation = self._manager.allocate_resources(token)
            record = record or JobRecord(job_id, JobState.ALLOCATED)
            return self._save(record.but(token=token, allocation=allocation))

    def free(self, job_id: str) -> JobRecord | None:
        """Give back what the job holds; None for a job this site never heard of."""
        with self._job(check_job_id(job_id)):
            record = self._get(job_id)
            if record is None:
                return None
            if record.state is JobState.RUNNING:
                raise FailedPrecondition(
                    f"job {job_id} is running on site {self.config.site}: abort it first",
                    field="job_id",
                )
            return self._release(record)

    # -- deploy, start, abort -------------------------------------------------------------------
    def deploy(self, job_id: str, app_name: str, url: str, expires_at_ms: int) -> JobRecord:
        if not APP_NAME.match(app_name):
            raise InvalidArgument(f"invalid app name {app_name!r}", field="app_name")
        with self._job(check_job_id(job_id)):
            record = self._get(job_id)
            if record is not None and record.app_name:
                if record.app_name == app_name:
                    return record  # a redelivered deploy
                raise AlreadyExists(
                    f"job {job_id} already has app {record.app_name!r} on site "
                    f"{self.config.site}", field="app_name",
                )
            if record is not None and record.state.final:
                raise FailedPrecondition(
                    f"job {job_id} is {record.state.value} on site {self.config.site}",
                    field="job_id",
                )
            if record is None or record.allocation is None:
                raise FailedPrecondition(
                    f"job {job_id} holds no resources on site {self.config.site}: only a job "
                    f"allocated here is deployed", field="job_id")
            what = f"the bundle of job {job_id}"
            bundle.check_url(url, self.config.storage_url,
                             Names(self.config.namespace).job_bundle_key(job_id, app_name), job_id)
            if bundle.expired(expires_at_ms, now_ms()):
                raise bundle.expired_error(job_id, expires_at_ms)
            data = self._download(url, what, self.config.max_bundle_bytes)
            try:
                files = bundle.install(data, self._ws.app_dir(job_id), self.config.archive_limits)
            except UnsafeArchive as err:
                raise UnsafeArchive([f"{what}: {v}" for v in err.violations],
                                    field=err.field) from None
            if self.hub is not None:  # the lower-tier job (same id), before anything is kept
                self.hub.deploy(job_id, self._ws.app_dir(job_id))
            self._log.info("site_agent.deployed", job_id=job_id, app=app_name, files=len(files))
            return self._save(record.but(state=JobState.DEPLOYED, app_name=app_name))

    def start(self, job_id: str) -> JobRecord:
        with self._job(check_job_id(job_id)):
            record = self._get(job_id)
            if record is None or not record.app_name:
                raise FailedPrecondition(
                    f"job {job_id} was never deployed to site {self.config.site}",
                    field="job_id",
                )
            if record.state is not JobState.DEPLOYED:
                return record  # started before (a redelivered start), or already over
            if record.allocation is None:
                raise FailedPrecondition(
                    f"job {job_id} holds no resources on site {self.config.site}: "
                    f"allocate_resources first", field="job_id",
                )
            env = self._consumer.consume(record.allocation)
            route = Names(self.config.namespace).job_site_route(job_id, self.config.site)
            args = ["--site-dir", str(self.config.site_dir), "--job-id", job_id,
                    "--server-queue", route, *(["--hub"] if self.hub is not None else [])]
            for name in sorted(env):
                args += ["--resource-env", name]
            self._ws.last_words_file(job_id).unlink(missing_ok=True)  # only this run's count
            running = self._launcher.launch(
                self.config.client_job_module, args, cwd=self._ws.app_dir(job_id),
                env=child_environment(env), log_file=self._ws.log_file(job_id),
            )
            record = self._save(record.but(
                state=JobState.RUNNING, pid=running.pid, pid_started=running.pid_started
            ))
            self._procs[job_id] = running
            self._watch_in_thread(job_id, partial(self._watch, job_id, running))
            self._log.info("site_agent.started", job_id=job_id, pid=running.pid, env=env)
            return record

    def abort(self, job_id: str, reason: str) -> JobRecord:
        with self._job(check_job_id(job_id)):
            record = self._get(job_id)
            if record is None:
                raise NotFound(f"job {job_id} is not known on site {self.config.site}",
                               field="job_id")
            if not record.state.final:
                record = self._save(record.but(state=JobState.ABORTED,
                                               reason=reason or "aborted"))
                running = self._procs.get(job_id)  # None for one re-adopted: its pid only
                if running is not None or record.pid:
                    grace = self.config.abort_grace_s
                    killed = (running.stop(grace) if running is not None
                              else process.stop_group(record.pid, record.pid_started, grace))
                    self._log.info("site_agent.aborted", job_id=job_id, pid=record.pid,
                                   killed=killed, reason=record.reason)
            # A hub: the lower-tier job goes too (also when the client job died before), unless
            # the client job ended it after the run's end: this is then the runner's clean-up.
            ended = (self._ws.app_dir(job_id) / ENDED_MARK).exists()
            if self.hub is not None and record.app_name and not ended:
                self.hub.abort(job_id, record.reason)
            return self._release(record)

    # -- client jobs' ends -----------------------------------------------------------------------
    def _recover(self, record: JobRecord) -> JobRecord:
        """A job RUNNING before the restart: the same record when it is re-adopted, else LOST
        with its end recorded (the earlier manager's allocation is gone with it)."""
        if not process.alive(record.pid, record.pid_started):
            lost = record.but(state=JobState.LOST, reason=GONE, token="", allocation=None)
            return self._with_end(lost, None)
        try:
            if record.allocation is not None:
                self._manager.restore(record.token, record.allocation)
        except Exception as err:  # a third-party manager may raise anything
            process.stop_group(record.pid, record.pid_started, self.config.abort_grace_s)
            lost = record.but(state=JobState.LOST, reason=one_line(f"{NOT_RESTORED}: {err}"),
                              token="", allocation=None)
            return self._with_end(lost, None)
        return record

    def _watch_in_thread(self, job_id: str, watch: Callable[[], None]) -> None:
        watcher = threading.Thread(target=watch, name=f"client-job-{job_id}", daemon=True)
        with self._lock:
            self._watchers = [w for w in self._watchers if w.is_alive()]
            self._watchers.append(watcher)
        watcher.start()

    def _watch(self, job_id: str, running: Running) -> None:
        self._end(job_id, running.wait())

    def _watch_adopted(self, record: JobRecord) -> None:
        """A client job that is not this agent's child: poll until it is gone."""
        if process.wait_gone(record.pid, record.pid_started, self._stopping, ADOPTED_POLL_S):
            self._end(record.job_id, None)

    def _end(self, job_id: str, code: int | None) -> None:
        """Record the end of the job's client job (`code`: its exit status, None when unknown)
        and free what it held."""
        with self._job(job_id):
            self._procs.pop(job_id, None)
            record = self._get(job_id)
            assert record is not None
            if record.state is JobState.RUNNING:
                record = record.but(state=JobState.FINISHED)
            record = self._with_end(record, code)
            self._log.info("site_agent.client_job_exited", job_id=job_id,
                           exit_code=record.exit_code, state=record.state.value,
                           exit_reason=record.exit_reason)
            self._release(record)
        self.notice_due.set()

    def _with_end(self, record: JobRecord, code: int | None) -> JobRecord:
        words = self._ws.load_last_words(record.job_id)
        if code is None and words is not None:
            code = words.exit_code
        return record.but(exit_code=code, exit_reason=self._why(record.job_id, code, words),
                          notice_pending=True)

    def _why(self, job_id: str, code: int | None, words: LastWords | None) -> str:
        """Why the client job ended, one line: its last words, else what its exit status (and,
        for an error exit, the last line of its log) says."""
        if words is not None:
            if code is not None and code != words.exit_code:  # e.g. SIGKILL while finishing
                return one_line(f"{words.reason}; then {process.describe_exit(code)}")
            return words.reason
        if code is None:
            return ("it ended without last words while not the site agent's child: exit code "
                    "unknown (killed by a signal?)")
        why = process.describe_exit(code)
        if code > 0 and (tail := self._ws.log_tail(job_id)):
            why = f"{why}: {tail}"
        return one_line(why)

    # -- internals ------------------------------------------------------------------------------
    def _release(self, record: JobRecord) -> JobRecord:
        """Free what the record holds (if anything) and save it."""
        if record.allocation is not None:
            self._manager.free_resources(record.token)
            self._log.info("site_agent.freed", job_id=record.job_id, resources=record.allocation)
            record = record.but(token="", allocation=None)
        return self._save(record)

    def _get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._records.get(job_id)

    def _save(self, record: JobRecord) -> JobRecord:
        """Write `record`, then keep it, stamped as it becomes what the heartbeats list: the
        runner holds a site's later heartbeats to the stamp a start replies with
        (`fedhive_services.job_runner.liveness`), and a write can take longer than its slack
        (a host of 100 light sites starting a job at once)."""
        self._ws.save_job(record)
        with self._lock:
            if self._records.get(record.job_id) is not record:  # a change, not a re-save
                record = record.but()
            self._records[record.job_id] = record
        return record

    def _job(self, job_id: str) -> threading.Lock:
        with self._lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

