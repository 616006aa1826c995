"""One site's jobs: resources, deployed bundles and client-job processes. No transport here:
`handlers` translates the control queue's protobuf to these calls.

Every command is idempotent (a redelivered one returns the job as it is now) and runs under its
job's lock, so two deliveries of the same command never overlap. Each change of a job is saved
to its record file before the command returns (see `records`).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from fedhive.config import child_environment
from fedhive.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from fedhive.jobs.archive import UnsafeArchive
from fedhive.jobs.validation import APP_NAME
from fedhive.resources import CheckResult, SiteResources

from . import bundle, process
from .config import SiteConfig
from .records import (
    JobRecord,
    JobState,
    Workspace,
    check_job_id,
    now_ms,
)

log = structlog.get_logger()

Downloader = Callable[[str, str, int], bytes]  # (url, what, limit) -> body


def _download(url: str, what: str, limit: int) -> bytes:
    body: bytes = bundle.download(url, what=what, limit=limit)
    return body


class SiteAgent:
    def __init__(
        self,
        config: SiteConfig,
        resources: SiteResources,
        workspace: Workspace,
        *,
        downloader: Downloader = _download,
    ) -> None:
        self.config = config
        self._manager = resources.manager
        self._consumer = resources.consumer
        self._ws = workspace
        self._download = downloader
        self._lock = threading.Lock()
        self._job_locks: dict[str, threading.Lock] = {}
        self._records: dict[str, JobRecord] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._watchers: list[threading.Thread] = []
        self._log = log.bind(site=config.site)

    # -- lifecycle ------------------------------------------------------------------------------
    def reconcile(self) -> list[JobRecord]:
        """At start: no job may stay RUNNING or hold resources from before. A client job that
        outlived a killed agent is stopped (its allocation died with the old agent's resource
        manager, so its GPUs could be handed out again); every such job becomes LOST."""
        self._ws.create()
        changed = []
        for record in self._ws.load_jobs():
            updated = record
            if record.state is JobState.RUNNING:
                if process.alive(record.pid, record.pid_started):
                    process.stop_group(record.pid, record.pid_started, self.config.abort_grace_s)
                    reason = "client job stopped: the site agent restarted"
                else:
                    reason = "client job was gone when the site agent restarted"
                updated = record.but(state=JobState.LOST, reason=reason, token="", allocation=None)
            elif record.allocation is not None:
                updated = record.but(token="", allocation=None)
            if updated is not record:
                self._ws.save_job(updated)
                changed.append(updated)
                self._log.warning("site_agent.reconciled", job_id=record.job_id,
                                  was=record.state.value, now=updated.state.value,
                                  reason=updated.reason)
            self._records[record.job_id] = updated
        return changed

    def shutdown(self) -> None:
        """Clean shutdown: abort running client jobs (none may outlive its agent)."""
        for job_id in self.running_job_ids():
            self.abort(job_id, "the site agent shut down")
        for watcher in list(self._watchers):
            watcher.join(timeout=self.config.abort_grace_s + 5)

    # -- queries --------------------------------------------------------------------------------
    def jobs(self) -> list[JobRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.job_id)

    def running_job_ids(self) -> list[str]:
        return [r.job_id for r in self.jobs() if r.state is JobState.RUNNING]

    def report_resources(self) -> dict[str, Any]:
        return self._manager.report_resources()

    # -- resources ------------------------------------------------------------------------------
    def check_resources(self, job_id: str, requirement: Mapping[str, Any]) -> CheckResult:
        check_job_id(job_id)
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
            if bundle.expired(expires_at_ms, now_ms()):
                raise bundle.expired_error(job_id, expires_at_ms)
            what = f"the bundle of job {job_id}"
            data = self._download(url, what, self.config.max_bundle_bytes)
            try:
                files = bundle.install(data, self._ws.app_dir(job_id), self.config.archive_limits)
            except UnsafeArchive as err:
                raise UnsafeArchive([f"{what}: {v}" for v in err.violations],
                                    field=err.field) from None
            record = record or JobRecord(job_id, JobState.DEPLOYED)
            self._log.info("site_agent.deployed", job_id=job_id, app=app_name, files=len(files))
            return self._save(record.but(state=JobState.DEPLOYED, app_name=app_name))

    def start(self, job_id: str, server_queue: str) -> JobRecord:
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
            args = ["--site-dir", str(self.config.site_dir), "--job-id", job_id,
                    "--server-queue", server_queue]
            for name in sorted(env):
                args += ["--resource-env", name]
            proc = process.spawn(
                self.config.client_job_module, args, cwd=self._ws.app_dir(job_id),
                env=child_environment(env), log_file=self._ws.log_file(job_id),
            )
            record = self._save(record.but(
                state=JobState.RUNNING, pid=proc.pid, pid_started=process.start_time(proc.pid)
            ))
            self._procs[job_id] = proc
            watcher = threading.Thread(target=self._watch, args=(job_id, proc),
                                       name=f"client-job-{job_id}", daemon=True)
            self._watchers.append(watcher)
            watcher.start()
            self._log.info("site_agent.started", job_id=job_id, pid=proc.pid, env=env)
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
                if record.pid:
                    killed = process.stop_group(record.pid, record.pid_started,
                                                self.config.abort_grace_s)
                    self._log.info("site_agent.aborted", job_id=job_id, pid=record.pid,
                                   killed=killed, reason=record.reason)
            return self._release(record)

    # -- internals ------------------------------------------------------------------------------
    def _watch(self, job_id: str, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self._job(job_id):
            self._procs.pop(job_id, None)
            record = self._get(job_id)
            assert record is not None
            if record.state is JobState.RUNNING:
                record = record.but(state=JobState.FINISHED)
            self._log.info("site_agent.client_job_exited", job_id=job_id, exit_code=code,
                           state=record.state.value)
            self._release(record.but(exit_code=code))

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
        self._ws.save_job(record)
        with self._lock:
            self._records[record.job_id] = record
        return record

    def _job(self, job_id: str) -> threading.Lock:
        with self._lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

