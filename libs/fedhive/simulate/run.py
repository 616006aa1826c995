"""`fedhive simulate`: a job's server app and N sites in one process, with no broker, Redis or S3.

The code that runs is a deployment's: the server side is the server job's `serve_app` (task
server, task manager, the app's workflows and components), each site is a client job's `Worker`
with the executors of its app (client-API trainers are real subprocesses). Only the ports
change: the bus is a `MemoryBroker` (each site its own broker user, checked by the task server
as RabbitMQ's `user_id` is), tensors go to a `LocalBlobStore` (files and presigned URLs served
on 127.0.0.1), and the job record lives in a `MemoryStateStore`, through the same status
machine. A site whose client job could not start or ended with an error leaves the job as the
job-runner would take it out, so a job that fails at a site ends with the status it would have
in a deployment.

Layout of `WORKSPACE/<job_id>/` (the first three are what `fedhive download` writes):

    job.zip      the job as fedhive stores it
    result.zip   the server job's workspace: metrics.json, models, cross-site tables
    meta.json    the job record (`fedhive job --json`)
    server/app/  server/workspace/   the server app and its workspace (result.zip's files,
                 its log `server_job.log` among them, as in a deployment)
    <site>/app/  each site's app, the folder its executors and trainers run in
    <site>/client_job.log   the site's log lines (JSON)
    simulate.log the simulation's own log lines

`threads` bounds how many sites execute a task at the same time (FLARE's `-t`); the others
wait their turn. Every site learns its name as in a deployment (`ExecTask.site`,
`fedhive.client.get_site_name()`), and `FEDHIVE_NUM_SITES` holds the number of sites. Trainers
get a share of the CPUs (`OMP_NUM_THREADS`, unless set) as they would on machines of their own.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive.blobs import LocalBlobStore, TensorCodec
from fedhive.bus import MemoryBroker, MemoryBus
from fedhive.cli.render import job_json
from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.fl.components import ComponentError
from fedhive.fl.executor import ExecTask, Executor, Executors
from fedhive.fl.server_job import END_RUN_GRACE_S, RoundReports, serve_app
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.task_server import could_not_start
from fedhive.fl.worker import Worker, WorkerConfig, one_line, send_worker_exit
from fedhive.fl.workflow import RoundReport, WorkflowContext
from fedhive.jobs.archive import write_folder_zip
from fedhive.jobs.definition import JobDefinition, load_job
from fedhive.jobs.record import JobRecord, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.jobs.validation import SERVER
from fedhive.logging import configure, file_logger
from fedhive.names import Names
from fedhive.proto.v1 import runner_pb2
from fedhive.simulate.plan import Plan, plan
from fedhive.state.memory_store import MemoryStateStore
from fedhive.state.port import JobUpdate
from fedhive.state.runs import Outcome

SERVICES_USER = "simulator"  # the server side's broker user (a deployment's services' user)
ENV_NUM_SITES = "FEDHIVE_NUM_SITES"
LOG_FILE = "simulate.log"
SERVER_LOG = "server_job.log"  # in the server's workspace, as the job-runner puts it
SITE_LOG = "client_job.log"
_BLOBS = ".blobs"  # the job's objects while it runs; deleted at the end
_STOP_WAIT_S = 10.0  # how long an aborted site's running task gets to return


@dataclass(frozen=True)
class Options:
    num_sites: int | None = None  # sites site-1..N
    sites: tuple[str, ...] = ()  # or these names
    threads: int | None = None  # sites executing a task at once; None: all of them
    workspace: Path = Path("simulate")
    log_level: str = "INFO"


@dataclass(frozen=True)
class Simulated:
    record: JobRecord  # its `sites`: the simulated sites
    folder: Path  # WORKSPACE/<job_id>

    @property
    def completed(self) -> bool:
        return self.record.status is JobStatus.FINISHED_COMPLETED


@dataclass
class _Site:
    name: str
    app_dir: Path
    bus: MemoryBus
    thread: threading.Thread | None = field(default=None, repr=False)
    failed: str = ""  # why its client job ended early, as the job-runner would learn it


def simulate(source: Path, options: Options, *, abort: threading.Event | None = None,
             on_round: Callable[[RoundReport], None] | None = None) -> Simulated:
    """Run the job at `source` (a folder or zip) to its end; the final record and where its
    files are. Raises `InvalidArgument` (an invalid job, sites that do not fit it) before
    anything is written; `abort` ends the run early (FINISHED:ABORTED)."""
    settings = Settings.from_env()  # the namespace, inline threshold, log level
    definition = load_job(source)
    sites = plan(definition, num_sites=options.num_sites, names=options.sites)
    job_id = str(uuid.uuid4())
    folder = options.workspace.resolve() / job_id
    folder.mkdir(parents=True)
    return Simulation(definition, sites, job_id, folder, options, settings,
                      abort or threading.Event(), on_round).run()


class Simulation:
    def __init__(self, definition: JobDefinition, plan: Plan, job_id: str, folder: Path,
                 options: Options, settings: Settings, abort: threading.Event,
                 on_round: Callable[[RoundReport], None] | None) -> None:
        self.definition = definition
        self.plan = plan
        self.job_id = job_id
        self.folder = folder
        self.abort = abort
        self.on_round = on_round
        self.settings = settings
        self.names = Names(self.settings.namespace)
        self.state = MemoryStateStore()
        self.broker = MemoryBroker()
        self.threads = options.threads or len(plan.sites)
        self.turns = threading.BoundedSemaphore(self.threads)
        self.sites_abort = threading.Event()
        self._log_file = (folder / LOG_FILE).open("a", buffering=1)
        self.log = configure("simulate", level=options.log_level, stream=self._log_file,
                             context={"job_id": job_id})

    def run(self) -> Simulated:
        try:
            return self._simulate()
        finally:
            self._log_file.close()

    def _simulate(self) -> Simulated:
        definition, job_id = self.definition, self.job_id
        definition.to_zip(self.folder / "job.zip")
        self.state.create_job(job_id, definition.meta, Submitter(_user()),
                              archive_key="job.zip")
        apps = {where: self._install(where, app) for where, app in self.plan.apps.items()}
        self._status(JobStatus.SUBMITTED, JobStatus.DISPATCHED, "simulated",
                     JobUpdate(sites=self.plan.sites))
        self._status(JobStatus.DISPATCHED, JobStatus.RUNNING, "all sites started")
        store = LocalBlobStore(self.folder / _BLOBS)
        store.ensure_bucket()
        codec = TensorCodec(store, self.settings)
        environment = self._environment()
        os.environ.update(environment)
        try:
            outcome, gone = self._run(apps, store, codec)
        finally:
            codec.close()
            store.close()
            shutil.rmtree(self.folder / _BLOBS, ignore_errors=True)
            for name in environment:
                os.environ.pop(name, None)
        record = self._finish(outcome, gone)
        self.log.info("simulate.ended", status=record.status.value)
        return Simulated(record, self.folder)

    def _environment(self) -> dict[str, str]:
        """What the run adds to the environment trainers inherit: the number of sites and,
        unless set already, a share of the CPUs per trainer (`OMP_NUM_THREADS`): trainers
        that each take every core of one machine run several times slower than with a share
        (hello-pt, 2 sites on 2 cores: 34 s against 9.6 s)."""
        environment = {ENV_NUM_SITES: str(len(self.plan.sites))}
        if "OMP_NUM_THREADS" not in os.environ:
            busy = min(len(self.plan.sites), self.threads)
            environment["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // busy))
        return environment

    def _run(self, apps: dict[str, Path], store: LocalBlobStore, codec: TensorCodec,
             ) -> tuple[Outcome, dict[str, str]]:
        """The server app and the sites to the end of the run; how the server side ended and
        which sites left the job."""
        workspace = self.folder / SERVER / "workspace"
        workspace.mkdir(parents=True)
        bus = MemoryBus(self.broker, SERVICES_USER, self.names)
        with (workspace / SERVER_LOG).open("a", buffering=1) as server_log:
            log = file_logger(server_log, service="server-job", job_id=self.job_id)
            ctx = WorkflowContext(job_id=self.job_id, sites=self.plan.sites,
                                  workspace=workspace, log=log,
                                  tasks=TaskManager(self.plan.sites, log=log), store=store,
                                  codec=codec, names=self.names)
            return self._serve(ctx, bus, apps)

    def _serve(self, ctx: WorkflowContext, bus: MemoryBus, apps: dict[str, Path],
               ) -> tuple[Outcome, dict[str, str]]:
        reports = RoundReports(self.job_id, ctx.workspace, None, ctx.log)
        ctx.report_round = lambda report: self._round(reports, report)
        outcomes: list[Outcome] = []
        server = threading.Thread(
            target=lambda: outcomes.append(serve_app(ctx, bus, apps[SERVER])),
            name="server-job", daemon=True)
        server.start()
        sites = [self._start_site(site, apps[site], bus) for site in self.plan.sites]
        while server.is_alive():
            server.join(0.1)
            if self.abort.is_set() and not ctx.abort.is_set():
                self.log.warning("simulate.aborting")
                ctx.abort.set()
        self._stop_sites(sites)
        bus.close()
        # A site that failed after the server side ended (its WorkerExit unread) failed too.
        gone = {site.name: site.failed for site in sites if site.failed} | ctx.gone_sites()
        if self.abort.is_set():
            return Outcome("aborted"), gone
        return outcomes[0], gone

    def _round(self, reports: RoundReports, report: RoundReport) -> None:
        reports(report)
        if self.on_round is not None:
            self.on_round(report)

    # sites ------------------------------------------------------------------------------
    def _start_site(self, site: str, app_dir: Path, services: MemoryBus) -> _Site:
        entry = _Site(site, app_dir, MemoryBus(self.broker, self.names.site_user(site),
                                               self.names))
        entry.thread = threading.Thread(target=self._serve_site, args=(entry, services),
                                        name=f"site.{site}", daemon=True)
        entry.thread.start()
        return entry

    def _serve_site(self, site: _Site, services: MemoryBus) -> None:
        with (site.app_dir.parent / SITE_LOG).open("a", buffering=1) as out:
            self._client_job(site, services, file_logger(
                out, service="client-job", site=site.name, job_id=self.job_id))

    def _client_job(self, site: _Site, services: MemoryBus, log: Any) -> None:
        """A client job: build the executors, run the worker loop to END_RUN. An app whose
        executors do not build tells the server job (`WorkerExit`), as the client job does;
        a worker that fails is reported gone, as the job-runner reports an ended client job."""
        route = self.names.job_site_route(self.job_id, site.name)
        try:
            executors = Executors.load(site.app_dir)
        except ComponentError as err:
            log.error("client_job.bad_executor_config", error=str(err))
            site.failed = could_not_start(str(err))
            send_worker_exit(site.bus, route, self.job_id, site.name, str(err))
            return
        worker = Worker(site.bus, _taking_turns(executors, self.turns), WorkerConfig(
            job_id=self.job_id, site=site.name, server_queue=route, workspace=site.app_dir,
            inline_threshold=self.settings.inline_threshold,
        ), abort=self.sites_abort, log=log)
        try:
            worker.run()
        except Exception as err:  # FedhiveError or a bug: either way the site is out
            why = f"client job exited with code 1: {one_line(err)}"  # as the runner says it
            log.error("client_job.failed", error=why, exc_info=True)
            site.failed = why
            try:
                services.send(self.names.job_server_queue(self.job_id), runner_pb2.SiteGone(
                    job_id=self.job_id, site=site.name, reason=why))
            except FedhiveError as gone_err:  # the server side ended already
                log.info("simulate.site_gone_unsent", error=str(gone_err))

    def _stop_sites(self, sites: list[_Site]) -> None:
        """After the server side ended: sites get END_RUN's grace to leave on their own, then
        are stopped (an aborted run, a site still in a task)."""
        for site in sites:
            assert site.thread is not None
            site.thread.join(END_RUN_GRACE_S)
        if any(site.thread is not None and site.thread.is_alive() for site in sites):
            self.sites_abort.set()
            for site in sites:
                assert site.thread is not None
                site.thread.join(_STOP_WAIT_S)
                if site.thread.is_alive():
                    self.log.warning("simulate.site_not_stopped", site=site.name)
        for site in sites:
            site.bus.close()

    # files and the record ---------------------------------------------------------------
    def _install(self, where: str, app: str) -> Path:
        """Write `app`'s files into WHERE/app/, as a deployment unpacks a bundle."""
        target = self.folder / where / "app"
        files = self.definition.files.subtree(app)
        for name in files.names():
            path = target / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(files.read(name))
        target.mkdir(parents=True, exist_ok=True)
        return target

    def _status(self, expected: JobStatus, new: JobStatus, reason: str,
                update: JobUpdate | None = None) -> JobRecord:
        return self.state.change_status(self.job_id, expected, new, reason, update=update)

    def _finish(self, outcome: Outcome, gone: dict[str, str]) -> JobRecord:
        with (self.folder / "result.zip").open("wb") as out:
            write_folder_zip(self.folder / SERVER / "workspace", out)
        if outcome.result == "aborted":
            new, reason = JobStatus.FINISHED_ABORTED, "aborted by the user"
        elif outcome.completed:
            new, reason = JobStatus.FINISHED_COMPLETED, "server job completed"
        else:
            new, reason = JobStatus.FINISHED_EXECUTION_EXCEPTION, outcome.error
        states = {site: {"allocated": True, "deployed": True, "started": True, "excluded": "",
                         "gone": gone.get(site, ""), "last_heartbeat_ms": 0}
                  for site in self.plan.sites}
        record = self._status(JobStatus.RUNNING, new, reason, JobUpdate(
            result_key="result.zip", failed_sites=sorted(gone), site_states=states))
        (self.folder / "meta.json").write_text(
            json.dumps(job_json(record, record.end_time_ms or 0), indent=2) + "\n")
        return record


def _user() -> str:
    """Who runs the simulation: the job's submitter."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user with no name
        return "simulator"


def _taking_turns(executors: Executors, turns: threading.BoundedSemaphore) -> Executors:
    """`executors`, each running a task only while it holds one of `turns`."""
    wrapped: dict[int, Executor] = {}
    by_task = {}
    for task, executor in executors.by_task.items():
        by_task[task] = wrapped.setdefault(id(executor), _Turn(executor, turns))
    return Executors(by_task=by_task, components=executors.components)


class _Turn:
    def __init__(self, executor: Executor, turns: threading.BoundedSemaphore) -> None:
        self._executor = executor
        self._turns = turns

    def execute(self, task: ExecTask) -> Any:
        with self._turns:
            return self._executor.execute(task)

    def finalize(self) -> None:
        finalize = getattr(self._executor, "finalize", None)
        if callable(finalize):
            finalize()
