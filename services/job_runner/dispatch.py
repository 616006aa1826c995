"""`DispatchJob`: from DISPATCHED to RUNNING, or to FINISHED:FAILED_TO_RUN.

Take the job's ownership lease, allocate on the chosen sites, pack one bundle per app to S3,
deploy in parallel (a deploy that does not answer within `sync_timeout_s` failed), check the
minimums (`min_clients`, mandatory sites), launch the server job, start the client jobs (a
start timeout excludes only the stragglers when the rest still meet the minimums; an explicit
start error is fatal), then DISPATCHED -> RUNNING by compare-and-set. A job aborted meanwhile
loses that compare-and-set (or is seen at a step's check) and is cleaned up, never started.

A dispatch for a job that is not DISPATCHED, or that a runner already took, is ignored with a
log line; for a job no longer DISPATCHED its reservations are cancelled. A dispatch that a dead
runner left half done (its entry still deploying or starting, the ownership lease free again)
is resumed from that entry: every site call is idempotent (allocate with the same token, deploy
of the same bundle, start of a started job) and a server job that is still alive, or already
reported, is kept rather than launched twice. A command without sites (the monitor's re-issue
of a lost one) takes the sites and reservations from the job record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fedhive.bus import Delivery
from fedhive.config import child_environment
from fedhive.errors import FedhiveError, IllegalTransition, InvalidArgument, NotFound, RpcTimeout
from fedhive.jobs.archive import STORED, write_zip
from fedhive.jobs.definition import JobDefinition, load_job
from fedhive.jobs.events import publish_status
from fedhive.jobs.record import JobMeta, JobRecord
from fedhive.jobs.status import JobStatus
from fedhive.jobs.tiers import OPERATORS_FILE, operators_file
from fedhive.proto.v1 import runner_pb2, site_pb2
from fedhive.state.port import JobUpdate
from fedhive.state.runs import RunEntry, SiteState

from . import server_job
from .context import RunnerContext, fence, lease_name
from .finish import conclude, record_sites, wind_up
from .monitor import max_runtime
from .sites import call_sites, cancel, describe, release

BUNDLE_URL_LIFETIME_S = 3600
D = JobStatus.DISPATCHED


def handle_dispatch(ctx: RunnerContext, request: runner_pb2.DispatchJob, delivery: Delivery,
                    ) -> None:
    ctx.check_owner()
    job_id = request.job_id
    log = ctx.log.bind(job_id=job_id)
    tokens = {s.site: s.token for s in request.sites}
    try:
        record: JobRecord | None = ctx.state.get_job(job_id)
    except NotFound:
        record = None
    if record is not None and not tokens:
        tokens = {site: record.reservations.get(site, "") for site in record.sites}
    if record is None or record.status != D:
        log.warning("job_runner.dispatch_ignored", message_id=delivery.message_id,
                    status=record.status.value if record else "unknown job",
                    why="the job is not DISPATCHED; its reservations are cancelled")
        cancel(ctx, job_id, tokens)
        return
    token = ctx.state.acquire(lease_name(job_id), ctx.config.holder, ctx.config.lease_ttl_s)
    with ctx.job_lock(job_id):
        left = ctx.runs.get(job_id)  # holding the lease and the lock: no one else works on it
        if token is None or (left is not None and left.phase == "running"):
            log.warning("job_runner.dispatch_duplicate", message_id=delivery.message_id,
                        why="the job is already being run")
            return
        if left is not None:
            entry = replace(left, runner=ctx.config.holder, fence_token=token)
            log.info("job_runner.dispatch_resumed", phase=left.phase, left_by=left.runner,
                     fence_token=token)
        else:
            entry = RunEntry(job_id, ctx.config.holder, token, "deploying",
                             sites={site: SiteState(token=t) for site, t in tokens.items()},
                             workspace=str(ctx.config.work_dir / job_id))
            log.info("job_runner.dispatch", sites=sorted(tokens), fence_token=token)
        ctx.runs.put(entry)
        _Dispatch(ctx, entry, record).run()


class _Dispatch:
    def __init__(self, ctx: RunnerContext, entry: RunEntry, record: JobRecord) -> None:
        self.ctx = ctx
        self.entry = entry
        self.meta: JobMeta = record.meta
        self.resumed_from = record.resumed_from  # its server job continues that checkpoint
        self.archive_key = record.archive_key or ctx.names.job_definition_key(record.job_id)
        self.log = ctx.log.bind(job_id=record.job_id)
        if "max_runtime" in self.meta.extra and max_runtime(record) is None:
            self.log.warning("job_runner.max_runtime_ignored",
                             value=self.meta.extra["max_runtime"],
                             why="max_runtime is not a positive number of seconds")

    @property
    def job_id(self) -> str:
        return self.entry.job_id

    def save(self, entry: RunEntry) -> None:
        self.entry = entry
        self.ctx.runs.put(entry)

    def run(self) -> None:
        try:
            definition = load_job(self.ctx.blobs.get(self.archive_key), STORED)
        except InvalidArgument as err:  # retrying cannot help: the job can never run
            conclude(self.ctx, self.entry, D, JobStatus.FINISHED_FAILED_TO_RUN,
                     f"the stored job definition cannot be loaded: {err}")
            return
        self.allocate()
        record_sites(self.ctx, self.entry)
        if self.stopped() or self.short("deploy"):
            return
        self.deploy(definition)
        record_sites(self.ctx, self.entry)
        if self.stopped() or self.short("deploy"):
            return
        self.launch(definition)
        self.start()
        record_sites(self.ctx, self.entry)
        if self.stopped() or self.short("start"):
            return
        self.to_running()

    # steps ------------------------------------------------------------------------------
    def allocate(self) -> None:
        requests = {site: site_pb2.AllocateResourcesRequest(job_id=self.job_id,
                                                            token=self.entry.sites[site].token)
                    for site in self.active()}
        for site, reply in call_sites(self.ctx, requests,
                                      site_pb2.AllocateResourcesReply).items():
            self.site_result(site, reply, "allocation", allocated=True)

    def deploy(self, definition: JobDefinition) -> None:
        urls: dict[str, tuple[str, int]] = {}
        requests = {}
        for site in self.active():
            app = definition.app_for(site)
            if app is None:
                self.exclude(site, "the job deploys no app to it")
                continue
            if app not in urls:
                urls[app] = self.bundle(definition, app)
            url, expires = urls[app]
            requests[site] = site_pb2.DeployRequest(job_id=self.job_id, app_name=app,
                                                    bundle_url=url,
                                                    bundle_url_expires_at_ms=expires)
        for site, reply in call_sites(self.ctx, requests, site_pb2.SiteJob).items():
            self.site_result(site, reply, "deployment", deployed=True)

    def bundle(self, definition: JobDefinition, app: str) -> tuple[str, int]:
        files = definition.files.subtree(app)
        shipped = operators_file(definition)  # what a hub site needs of the server config
        data = write_zip([*[(name, _reader(files.read, name)) for name in files.names()
                            if name != OPERATORS_FILE], (OPERATORS_FILE, lambda: shipped)])
        assert data is not None
        key = self.ctx.names.job_bundle_key(self.job_id, app)
        self.ctx.blobs.put(key, data)
        url = self.ctx.blobs.presign_get(key, BUNDLE_URL_LIFETIME_S)
        return url.url, url.expires_at_ms

    def launch(self, definition: JobDefinition) -> None:
        if self.entry.pid and (server_job.exists(self.entry) or self.ctx.runs.alive(self.job_id)
                               or self.ctx.runs.outcome(self.job_id) is not None):
            self.log.info("job_runner.server_job_kept", pid=self.entry.pid,
                          why="launched before the dispatch was interrupted")
            self.save(replace(self.entry, phase="starting"))
            return
        app_dir = Path(self.entry.workspace) / "app"
        files = definition.files.subtree(definition.server_app)
        for name in files.names():
            target = app_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files.read(name))
        entry = server_job.launch(self.ctx, self.entry, child_environment(), self.active(),
                                  resume_from=self.resumed_from)
        self.save(RunEntry(**{**entry.__dict__, "phase": "starting"}))
        self.log.info("job_runner.server_job_launched", pid=entry.pid,
                      resume_from=self.resumed_from or None)

    def start(self) -> None:
        requests = {site: site_pb2.StartRequest(job_id=self.job_id) for site in self.active()}
        stragglers = []
        for site, reply in call_sites(self.ctx, requests, site_pb2.SiteJob).items():
            if isinstance(reply, RpcTimeout):
                stragglers.append(site)
            if isinstance(reply, FedhiveError):
                self.site_result(site, reply, "start")
            else:  # the site's time of the start: its later heartbeats must list the job
                self.site_result(site, reply, "start", started=True,
                                 started_at_ms=reply.updated_at_ms)
        if stragglers and not self.shortfall():
            self.log.warning("job_runner.stragglers_excluded", sites=stragglers,
                             why="no reply to start within the sync timeout")
            release(self.ctx, self.job_id, {s: "" for s in stragglers}, "excluded: no start reply")

    def to_running(self) -> None:
        sites = self.active()
        update = JobUpdate(sites=sites, failed_sites=sorted(set(self.entry.sites) - set(sites)))
        try:
            record = self.ctx.state.change_status(
                self.job_id, D, JobStatus.RUNNING, f"running on {', '.join(sites)}",
                update=update, fence=fence(self.job_id, self.entry.fence_token))
        except IllegalTransition:
            self.stopped()
            return
        publish_status(self.ctx.bus, record)
        self.save(RunEntry(**{**self.entry.__dict__, "phase": "running"}))
        self.log.info("job_runner.running", sites=sites, excluded=update.failed_sites)

    # bookkeeping --------------------------------------------------------------------------
    def site_result(self, site: str, reply: object, what: str, **done: bool | int) -> None:
        if isinstance(reply, FedhiveError):
            self.exclude(site, describe(reply, what),
                         fatal=what == "start" and not isinstance(reply, RpcTimeout))
        else:
            self.save(self.entry.with_site(site, **done))

    def exclude(self, site: str, why: str, *, fatal: bool = False) -> None:
        self.log.warning("job_runner.site_failed", site=site, why=why, fatal=fatal)
        self.save(self.entry.with_site(site, excluded=("fatal: " if fatal else "") + why))

    def active(self) -> list[str]:
        return sorted(site for site, s in self.entry.sites.items() if not s.excluded)

    def shortfall(self) -> str | None:
        """Why the sites left cannot run the job, or None when they can."""
        problems = [f"{site}: {s.excluded.removeprefix('fatal: ')}"
                    for site, s in sorted(self.entry.sites.items()) if s.excluded]
        fatal = any(s.excluded.startswith("fatal: ") for s in self.entry.sites.values())
        required = self.meta.min_clients or len(self.entry.sites)
        ok = len(self.active())
        missing = [m for m in self.meta.mandatory_clients if m not in self.active()]
        if ok < required:
            problems.append(f"num_ok_sites {ok} < required_min_sites {required}")
        if missing:
            problems.append(f"mandatory site(s) failed: {', '.join(missing)}")
        if fatal or ok < required or missing:
            return "; ".join(problems)
        return None

    def short(self, step: str) -> bool:
        problem = self.shortfall()
        if problem is None:
            return False
        conclude(self.ctx, self.entry, D, JobStatus.FINISHED_FAILED_TO_RUN,
                 f"{step} failed: {problem}")
        return True

    def stopped(self) -> bool:
        """True (after cleaning up) when the job left DISPATCHED meanwhile (aborted)."""
        status = self.ctx.state.get_job(self.job_id).status
        if status == D:
            return False
        self.log.info("job_runner.dispatch_stopped", status=status.value)
        wind_up(self.ctx, self.entry, f"job is {status.value}")
        return True


def _reader(read: Callable[[str], bytes], name: str) -> Callable[[], bytes]:
    return lambda: read(name)
