"""The server-job process (SJ): runs one job's server app.

`python -m fedhive.fl.server_job --job-id ID --app-dir APP --workspace WS --site S ...` (the
job-runner starts it, in its own process group, with the FEDHIVE_* environment):

1. renews its liveness record in Redis every `--liveness-interval` seconds (`RunTable.beat`),
   so any runner (not only its parent) can tell it is alive;
2. serves `Names.job_server_queue(job_id)` on its own broker connection with the task
   transport (`fedhive.fl.task_server`: the sites' task polls, results and upload grants, and
   `SiteGone` from the runner), about two handler threads per site; a monitor thread runs the
   task manager's checks every 0.2 s;
3. loads `APP/config/config_fed_server.<json|conf|yml|yaml>` as the job validation read it
   (`fedhive.jobs.documents.load_app_config`: any of FLARE's forms, FLARE's component paths
   mapped), builds its `components` then its `workflows` by
   import path with their args (`APP/custom` is on sys.path), calls every workflow's
   `prepare(ctx)` (a bad component reference fails the job here), then runs the workflows in
   order (see `fedhive.fl.workflow`); each round a workflow reports is appended to
   `WORKSPACE/metrics.json` and to the job's round log in Redis (`fedhive.state.rounds`,
   what `fedhive metrics ID` reads while the job runs), and published as
   `job.round.completed`;
4. ends the run (`tasks.end_run()`): keeps serving until every site was told END_RUN (or is
   gone), at most `END_RUN_GRACE_S`, so client jobs exit on their own;
5. reports its outcome in Redis (`RunTable.report`): `completed`, or `exception` with the
   error — a component that cannot be built is an exception naming the component id.

`--resume-from OLD_ID` is handed to the workflows (`ctx.resume_from`): they continue from that
job's last checkpoint.

SIGTERM sets the workflows' abort event; the process reports and exits once they return (the
runner stops the client jobs of an aborted job itself). So does a stop request a runner on
another host leaves in Redis (`RunTable.ask_stop`), seen with the next liveness renewal.
Exit code 0 when completed, 1 after an exception, 2 for bad arguments or settings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhive.blobs import S3BlobStore, TensorCodec
from fedhive.bus import Bus, RabbitBus
from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.fl.components import build_component
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.task_server import TaskServer
from fedhive.fl.workflow import RoundReport, WorkflowContext
from fedhive.jobs.documents import SERVER_CONFIG, load_app_config
from fedhive.logging import configure
from fedhive.names import Names
from fedhive.proto.v1 import task_pb2
from fedhive.state.rounds import RoundLog
from fedhive.state.runs import Outcome, RunTable
from fedhive.structs import dict_to_struct

METRICS_FILE = "metrics.json"
_CLOSING = b"\n]}\n"  # what ends metrics.json
CHECK_INTERVAL_S = 0.2  # FLARE's task_check_period
END_RUN_GRACE_S = 3.0


def run_app(app_dir: Path, ctx: WorkflowContext) -> None:
    """Build the app's components and workflows, prepare every workflow, run them in order;
    raises what a component or workflow raised."""
    custom = app_dir / "custom"
    if custom.is_dir():
        sys.path.insert(0, str(custom))
    _, config = load_app_config(app_dir, SERVER_CONFIG)
    ctx.operators = config.get("operators")
    for index, spec in enumerate(config.get("components", [])):
        build_component(spec, f"components[{index}]", ctx.components)
    workflows = [
        build_component(spec, f"workflows[{index}]", ctx.components)
        for index, spec in enumerate(config.get("workflows", []))
    ]
    for workflow in workflows:
        prepare = getattr(workflow, "prepare", None)
        if callable(prepare):
            prepare(ctx)
    ctx.prepared.set()
    for workflow in workflows:
        if ctx.abort.is_set():
            return
        ctx.log.info("server_job.workflow", workflow=type(workflow).__name__)
        workflow.run(ctx)


class RoundReports:
    """`ctx.report_round`: each report appended to `WORKSPACE/metrics.json` (`{"rounds":
    [{workflow, round, num_rounds, metrics, time}]}`, part of the job's result) and to the
    job's round log in Redis (`rounds`: readable while the job runs), and published as the
    event `job.round.completed` (a Redis or broker hiccup is only logged)."""

    def __init__(self, job_id: str, workspace: Path, bus: Bus | None, log: Any,
                 rounds: RoundLog | None = None) -> None:
        self._job_id = job_id
        self._path = workspace / METRICS_FILE
        self._bus = bus
        self._log = log
        self._round_log = rounds
        self._rounds = 0
        self._lock = threading.Lock()

    def __call__(self, report: RoundReport) -> None:
        now = time.time()
        metrics = json.loads(json.dumps(report.metrics, default=_plain))
        entry = {"workflow": report.workflow, "round": report.round,
                 "num_rounds": report.num_rounds, "metrics": metrics, "time": now}
        with self._lock:
            self._append(entry)
        self._log.info("server_job.round_completed", workflow=report.workflow,
                       round=report.round, num_rounds=report.num_rounds)
        if self._round_log is not None:
            logged = {"workflow": report.workflow, "round": report.round,
                      "num_rounds": report.num_rounds, "metrics": metrics,
                      "at_ms": int(now * 1000)}
            try:
                self._round_log.append(self._job_id, logged)
            except Exception as err:  # Redis away: metrics.json still has the round
                self._log.warning("server_job.round_log_failed", round=report.round,
                                  error=str(err))
        if self._bus is None:
            return
        event = task_pb2.RoundCompleted(job_id=self._job_id, workflow=report.workflow,
                                        round=report.round, num_rounds=report.num_rounds,
                                        metrics=dict_to_struct(metrics), time_ms=int(now * 1000))
        try:
            self._bus.publish_event(Names.JOB_ROUND_COMPLETED, event)
        except FedhiveError as err:
            self._log.warning("server_job.round_event_failed", error=str(err))

    def _append(self, entry: dict[str, Any]) -> None:
        """Write the entry over the file's closing `]}`: the file stays one JSON document and
        a round costs the same at round 1,000 as at round 1 (rewriting the whole list made a
        long job's rounds slower and slower)."""
        text = json.dumps(entry, indent=1).replace("\n", "\n ")
        if self._rounds == 0:
            self._path.write_text('{"rounds": [\n ' + text + "\n]}\n")
        else:
            with self._path.open("r+b") as file:
                file.seek(-len(_CLOSING), os.SEEK_END)
                file.write((",\n " + text + "\n]}\n").encode())
        self._rounds += 1


def _plain(value: Any) -> Any:
    """JSON for numpy scalars and arrays in metrics; anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _liveness(table: RunTable, ctx: WorkflowContext, interval: float, stop: threading.Event,
              ) -> None:
    while not stop.is_set():
        try:
            if table.beat(ctx.job_id, os.getpid(), ttl_s=interval * 4) \
                    and not ctx.abort.is_set():
                ctx.log.warning("server_job.stop_asked",
                                why="a job-runner on another host ended the job")
                ctx.abort.set()  # as SIGTERM does
        except Exception as err:  # Redis away for a moment: the next beat tries again
            ctx.log.warning("server_job.beat_failed", error=str(err))
        stop.wait(interval)


def _monitor(tasks: TaskManager, log: Any, stop: threading.Event) -> None:
    """Task exit rules that only time can trigger (timeouts, waits after the minimum)."""
    while not stop.wait(CHECK_INTERVAL_S):
        try:
            tasks.check()
        except Exception as err:  # the next check tries again; never kill the monitor
            log.error("server_job.check_failed", error=repr(err), exc_info=True)


def _end_run(ctx: WorkflowContext, server: TaskServer) -> None:
    """No more tasks; wait (briefly) until every site was told so."""
    assert ctx.tasks is not None
    ctx.tasks.end_run()
    deadline = time.monotonic() + END_RUN_GRACE_S
    while not server.all_ended() and not ctx.abort.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.all_ended():
        ctx.log.info("server_job.end_run_unheard", aborted=ctx.abort.is_set())


def serve_app(ctx: WorkflowContext, bus: Bus, app_dir: Path) -> Outcome:
    """Steps 2 to 4: serve the job's task queue on `bus`, run the app, end the run; how it
    went. Shared by the server-job process and `fedhive simulate`."""
    assert ctx.tasks is not None and ctx.names is not None
    stop = threading.Event()
    monitor = threading.Thread(target=_monitor, args=(ctx.tasks, ctx.log, stop),
                               name="task-monitor", daemon=True)
    monitor.start()
    server = TaskServer(ctx, service_user=bus.user)
    serving = False
    try:
        # long polls wait parked, not in threads: these handle results, uploads and operations
        handlers = min(len(ctx.sites), 8) + 2
        server.serve(bus, ctx.names.job_server_queue(ctx.job_id), handlers=handlers)
        serving = True
        ctx.log.info("server_job.started", pid=os.getpid(), sites=ctx.sites)
        run_app(app_dir, ctx)
        outcome = Outcome("completed")
    except Exception as err:
        ctx.log.error("server_job.exception", error=f"{type(err).__name__}: {err}")
        outcome = Outcome("exception", f"{type(err).__name__}: {err}")
    if serving:
        _end_run(ctx, server)
    server.close()
    stop.set()
    monitor.join()
    return outcome


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedhive-server-job",
                                     description="Run one job's server app (started by the "
                                     "job-runner).")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--app-dir", required=True, type=Path)
    parser.add_argument("--workspace", required=True, type=Path)
    parser.add_argument("--site", action="append", default=[], dest="sites")
    parser.add_argument("--liveness-interval", type=float, default=1.0)
    parser.add_argument("--resume-from", default="",
                        help="a job id: continue from that job's last checkpoint")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings.from_env()
    except FedhiveError as err:
        print(f"fedhive-server-job: {err}", file=sys.stderr)
        return 2
    log = configure("server-job", level=settings.log_level, context={"job_id": args.job_id})
    args.workspace.mkdir(parents=True, exist_ok=True)
    names = Names(settings.namespace)
    store = S3BlobStore.from_settings(settings)
    codec = TensorCodec(store, settings)
    sites = list(args.sites)
    ctx = WorkflowContext(job_id=args.job_id, sites=sites, workspace=args.workspace, log=log,
                          tasks=TaskManager(sites, log=log), store=store, codec=codec,
                          names=names,
                          resume_from=args.resume_from)
    signal.signal(signal.SIGTERM, lambda *_: ctx.abort.set())
    table = RunTable.from_settings(settings)
    stop = threading.Event()
    liveness = threading.Thread(target=_liveness, name="liveness", daemon=True,
                                args=(table, ctx, args.liveness_interval, stop))
    liveness.start()
    bus = RabbitBus(settings, name=f"server-job.{args.job_id}")
    round_log = RoundLog.from_settings(settings)
    ctx.report_round = RoundReports(args.job_id, args.workspace, bus, log, rounds=round_log)
    outcome = serve_app(ctx, bus, args.app_dir)
    stop.set()
    liveness.join()
    table.report(args.job_id, outcome)
    log.info("server_job.ended", result=outcome.result, aborted=ctx.abort.is_set())
    bus.close()
    round_log.close()
    table.close()
    codec.close()
    store.close()
    return 0 if outcome.completed else 1


def forked_main(argv: list[str], cwd: str, log_path: str, env: dict[str, str]) -> None:
    """Entry point of an SJ forked by the job-runner's fork server (which has this module and
    its dependencies imported already, sparing each job a Python start-up): the process set-up
    Popen gives `python -m fedhive.fl.server_job` — its own session, `cwd`, stdout and stderr
    appended to `log_path`, the environment `env` (the one place the SJ writes `os.environ`:
    the fork server's own may be older than what the runner hands down) — then `main`."""
    os.setsid()
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
