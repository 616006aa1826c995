"""`fedhive-job-runner`: deploys, starts, monitors and finishes jobs.

Three duties in one process: the heartbeat intake and site registry (`heartbeats.py`), the
jobs' logs (`logs.py`: sites' log lines in; `server_logs.py`: the server jobs' own), and
running jobs: `DispatchJob` and `AbortJobRequest` on `{ns}.job-runner` (`dispatch.py`,
`abort.py`) and the monitor thread (`monitor.py`) that ends jobs, re-attaches after a restart
and heals from heartbeats. Before any of it, the process claims its runner id (`identity.py`):
a second live runner with the same id refuses to start (exit 2), and a runner whose id was taken
over while it was frozen or cut off shuts itself down. Configured by the FEDHIVE_* environment
(`Settings`) plus the options below.
"""

from __future__ import annotations

import argparse
import signal
import socket
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.bus import Consumer, Delivery, Handler, RabbitBus
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, runner_pb2
from fedhive.readiness import Check
from fedhive.readiness_checks import bucket_answers, consuming, redis_answers
from fedhive.service import positive_seconds, run
from fedhive.sites.intake import IntakeConfig
from fedhive.state import RedisStateStore
from fedhive.state.joblogs import JobLogStore
from fedhive.state.runs import RunTable

from .abort import handle_abort
from .context import RunnerConfig, RunnerContext
from .dispatch import handle_dispatch
from .heartbeats import HeartbeatIntake
from .identity import RunnerLease
from .logs import LogIntake
from .monitor import Monitor, recover
from .server_logs import ServerLogs

SERVICE = "job-runner"
CONCURRENCY = 4  # dispatches and aborts at once: an abort never waits behind a deployment


class JobRunner:
    """The composition of the running service; `close()` stops it in reverse order."""

    def __init__(self, ctx: RunnerContext, blobs: S3BlobStore, state: RedisStateStore,
                 bus: RabbitBus, lease: RunnerLease, heartbeats: HeartbeatIntake,
                 monitor: Monitor, logs: JobLogStore, log_intake: LogIntake,
                 server_logs: ServerLogs, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.blobs = blobs
        self.state = state
        self.bus = bus
        self.lease = lease
        self.heartbeats = heartbeats
        self.monitor = monitor
        self.logs = logs
        self.log_intake = log_intake
        self.server_logs = server_logs
        self.consumer: Consumer | None = None  # of {ns}.job-runner, set once it serves

    def ready_checks(self) -> list[Check]:
        consumers = [self.consumer, self.heartbeats.subscription, self.log_intake.subscription]
        assert None not in consumers  # asked only of a runner `build` returned, all started
        return [consuming(*(c for c in consumers if c is not None)), redis_answers(self.settings),
                bucket_answers(self.settings)]

    def close(self) -> None:
        """Server jobs keep running: a runner started again with the same id re-attaches."""
        self.heartbeats.close()
        self.log_intake.close()
        self.bus.close()
        self.monitor.close()
        self.server_logs.close()
        self.lease.close()
        self.ctx.runs.close()
        self.logs.close()
        self.blobs.close()
        self.state.close()


def shut_down() -> None:
    """A fenced runner's way out: the clean shutdown of SIGTERM (`fedhive.service.run`), sent
    to the main thread, the one waiting for it (the kernel may hand a process's signal to any
    thread)."""
    main = threading.main_thread().ident
    assert main is not None  # started: it runs this process
    signal.pthread_kill(main, signal.SIGTERM)


def make_handler(ctx: RunnerContext) -> Handler:
    def handle(message: Message, delivery: Delivery) -> Message | None:
        if isinstance(message, runner_pb2.DispatchJob):
            handle_dispatch(ctx, message, delivery)
            return None
        assert isinstance(message, admin_pb2.AbortJobRequest)  # the bus filters types
        return handle_abort(ctx, message, delivery)

    return handle


def build(settings: Settings, log: Any, *, options: Options) -> JobRunner:
    state = RedisStateStore.from_settings(settings)
    blobs = S3BlobStore.from_settings(settings)
    bus = RabbitBus(settings, name=SERVICE)
    names = Names(settings.namespace)
    log = log.bind(service=SERVICE)
    lease = RunnerLease(state, options.runner.holder, options.runner.lease_ttl_s, log,
                        on_fenced=shut_down)
    runs = RunTable.from_settings(settings)
    logs = JobLogStore.from_settings(settings)
    server_logs = ServerLogs(runs, logs, options.runner.holder, log)
    ctx = RunnerContext(state=state, blobs=blobs, bus=bus, names=names, runs=runs,
                        config=options.runner, log=log, owner=lease, server_logs=server_logs)
    heartbeats = HeartbeatIntake(bus, state, options.intake, log)
    log_intake = LogIntake(bus, state, logs, log)
    monitor = Monitor(ctx, heartbeats)
    runner = JobRunner(ctx, blobs, state, bus, lease, heartbeats, monitor, logs, log_intake,
                       server_logs, settings)
    try:
        lease.start()  # first: nothing is touched under an id another live runner holds
        heartbeats.start()
        log_intake.start()
        recover(ctx)
        monitor.start()
        server_logs.start()
        runner.consumer = bus.serve(names.service_queue(SERVICE), make_handler(ctx),
                                    [runner_pb2.DispatchJob, admin_pb2.AbortJobRequest],
                                    prefetch=CONCURRENCY * 2, concurrency=CONCURRENCY)
        log.info("job_runner.serving", queue=names.service_queue(SERVICE),
                 runner_id=options.runner.holder, holder=lease.holder,
                 work_dir=str(options.runner.work_dir),
                 storage_url=blobs.url_prefix())  # what each site.json's storage_url must say
    except BaseException:
        runner.close()
        raise
    return runner


@dataclass(frozen=True)
class Options:
    intake: IntakeConfig
    runner: RunnerConfig


def parse_args(argv: Sequence[str] | None = None) -> Options:
    defaults = IntakeConfig()
    parser = argparse.ArgumentParser(
        prog="fedhive-job-runner",
        description="fedhive job-runner: runs dispatched jobs; heartbeat intake and site "
        "registry. Broker, Redis and namespace come from FEDHIVE_* variables.",
    )
    parser.add_argument("--site-ttl", type=positive_seconds, default=defaults.site_ttl_s,
                        metavar="SECONDS",
                        help="a site is offline this long after its last heartbeat "
                        "(default %(default)s: 3 x the agents' 5 s interval)")
    parser.add_argument("--job-ttl", type=positive_seconds, default=defaults.job_ttl_s,
                        metavar="SECONDS", help="lifetime of a client job's last heartbeat "
                        "(default %(default)s)")
    parser.add_argument("--sweep-interval", type=positive_seconds,
                        default=defaults.sweep_interval_s,
                        metavar="SECONDS", help="how often expired sites are looked for "
                        "(default %(default)s)")
    parser.add_argument("--runner-id", default=socket.gethostname(),
                        help="this runner's id (default: the host name); a runner restarted "
                        "with the same id re-attaches to the server jobs it left running; one "
                        "live runner per id: a second one refuses to start")
    parser.add_argument("--work-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "fedhive-runner",
                        help="where server jobs' workspaces go (default %(default)s)")
    parser.add_argument("--sync-timeout", type=positive_seconds, default=10.0, metavar="SECONDS",
                        help="how long sites have to answer allocate, deploy and start; no "
                        "answer is a failure (default %(default)s)")
    parser.add_argument("--abort-grace", type=positive_seconds, default=5.0, metavar="SECONDS",
                        help="SIGTERM to SIGKILL of a server job (default %(default)s)")
    parser.add_argument("--lease-ttl", type=positive_seconds, default=15.0, metavar="SECONDS",
                        help="lifetime of the runner id's and the jobs' ownership leases, "
                        "renewed while the runner runs: a runner frozen or cut off from Redis "
                        "this long loses its jobs to a successor (default %(default)s)")
    parser.add_argument("--orphan-grace", type=positive_seconds, default=5.0, metavar="SECONDS",
                        help="a DISPATCHED job that no runner works on this long (its dispatch "
                        "command was lost, or its runner died mid-dispatch) is dispatched "
                        "again (default %(default)s)")
    args = parser.parse_args(argv)
    intake = IntakeConfig(site_ttl_s=args.site_ttl, job_ttl_s=args.job_ttl,
                          sweep_interval_s=args.sweep_interval)
    runner = RunnerConfig(holder=args.runner_id, work_dir=args.work_dir,
                          sync_timeout_s=args.sync_timeout, abort_grace_s=args.abort_grace,
                          lease_ttl_s=args.lease_ttl, orphan_grace_s=args.orphan_grace)
    return Options(intake, runner)


def main(argv: Sequence[str] | None = None) -> None:
    run(SERVICE, partial(build, options=parse_args(argv)))


if __name__ == "__main__":
    main()
