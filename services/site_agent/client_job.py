"""The client job (CJ): one process per job per site, started by the site agent.

    python -m fedhive_services.site_agent.client_job --site-dir DIR --job-id ID \
        --server-queue QUEUE [--resource-env NAME ...]

1. It reports itself, proving the plumbing the agent gives it: its own process (group), the
   resource consumer's environment (each `--resource-env` variable's value), the deployed app
   as its working directory, and the site's broker identity (its `JobHeartbeat` on
   `site.<site>.job` carries the site's AMQP user_id). The same facts go to
   `<workspace>/.agent/jobs/<job_id>.cj.json` for the site operator.
2. It builds the executors of the app's `config/config_fed_client.json`; a config that does not
   build is reported to the server job (`WorkerExit`, the site leaves the job) and ends the CJ
   with exit code 1.
3. It runs the worker loop (`fedhive.fl.worker`) against the server job's queue, sending a
   `JobHeartbeat` every `heartbeat_interval_s` (the runner takes a job whose beats stop for a
   gone site), and exits 0 once the server says END_RUN.

SIGTERM (the agent's abort) sets the executors' abort event; the CJ gives the running task a
moment to return, then dies by SIGTERM. Exit code 1 for any error that ends it (one line on
stderr).

Before it exits, however it exits (short of being killed), it writes its last words to
`<workspace>/.agent/jobs/<job_id>.end.json`: its exit code and why it ended, one line. Its
agent passes them on to the runner in the job's final `JobHeartbeat`.

`run_in_thread` is the same client job as a thread of a light-site host (`launch.Threads`):
the environment and the app folder are handed to it, its log lines go to the job's log file,
abort is an event, and the exit code is returned.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pika

from fedhive.bus import RabbitBus
from fedhive.config import Settings, environment_values
from fedhive.errors import FedhiveError
from fedhive.fl.components import ComponentError
from fedhive.fl.executor import ANY_TASK, Executors
from fedhive.fl.worker import Worker, WorkerConfig, send_worker_exit
from fedhive.heap import bound_heap
from fedhive.logging import configure, file_logger
from fedhive.names import Names
from fedhive.sites.heartbeat import JobHeartbeat
from fedhive.sites.serde import job_heartbeat_to_proto

from .config import SiteConfig, agent_settings, load_site
from .hub_config import HUB_FILE, load_hub
from .records import LastWords, Workspace, check_job_id, now_ms, one_line, write_json

# How soon the main thread sees an abort its worker does not end on (a task that ignores it):
# well inside the agent's grace. The worker's own end wakes it at once.
ABORT_CHECK_S = 1.0


@dataclass
class ClientJob:
    settings: Settings  # the site's broker identity, no S3 or Redis credentials
    config: SiteConfig
    job_id: str
    server_queue: str
    log: Any
    app_dir: Path  # the deployed app: the working directory of its executors and trainers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedhive-client-job", description=__doc__)
    parser.add_argument("--site-dir", type=Path, required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--server-queue", default="")
    parser.add_argument("--hub", action="store_true",
                        help="a hub site: run HubExecutor (local/hub.json) for every task")
    parser.add_argument("--resource-env", action="append", default=[],
                        help="a variable the resource consumer set (reported back)")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None,
            app_dir: Path | None = None, log_stream: TextIO | None = None) -> ClientJob:
    """The job from its arguments, the environment (this process's by default), the app folder
    (the working directory) and where to log (this process's stderr, configured)."""
    base = Settings.from_env(environ)
    config = load_site(args.site_dir)
    job_id = check_job_id(args.job_id)
    context = {"site": config.site, "job_id": job_id}
    log = (configure("client-job", level=base.log_level, context=context) if log_stream is None
           else file_logger(log_stream, service="client-job", **context))
    return ClientJob(agent_settings(base, config), config, job_id, args.server_queue, log,
                     app_dir or Path.cwd())


def report(job: ClientJob, args: argparse.Namespace, bus: RabbitBus,
           environ: Mapping[str, str] | None = None) -> None:
    """The report file and the first JobHeartbeat."""
    facts = {
        "job_id": job.job_id,
        "site": job.config.site,
        "pid": os.getpid(),
        "process_group": os.getpgid(0),
        "cwd": str(job.app_dir),
        "server_queue": job.server_queue,
        "resource_env": environment_values(args.resource_env, environ),
        "broker_user": pika.URLParameters(job.settings.amqp_url).credentials.username,
        "started_at_ms": now_ms(),
    }
    write_json(Workspace(job.config.workspace).report_file(job.job_id), facts)
    beat(job, bus, "started")
    job.log.info("client_job.reported", resource_env=facts["resource_env"])


def run(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None,
        app_dir: Path | None = None, log_stream: TextIO | None = None) -> ClientJob:
    """Step 1 alone (the report), on a connection of its own (`prepare`'s options)."""
    job = prepare(args, environ=environ, app_dir=app_dir, log_stream=log_stream)
    bus = RabbitBus(job.settings, name=f"client-job.{job.job_id}", site=True)
    try:
        report(job, args, bus, environ)
    finally:
        bus.close()
    return job


def beat(job: ClientJob, bus: RabbitBus, current_task: str) -> None:
    heartbeat = JobHeartbeat(job_id=job.job_id, site=job.config.site,
                             sent_at_ms=int(time.time() * 1000), current_task=current_task,
                             progress=0.0)
    bus.publish_event(Names.site_event(job.config.site, "job"),
                      job_heartbeat_to_proto(heartbeat))


def executors_for(job: ClientJob, hub: bool, abort: threading.Event) -> Executors:
    """The app's executors, or at a hub site `HubExecutor` for every task."""
    if not hub:
        return Executors.load(job.app_dir)
    config = load_hub(job.config.site_dir)
    if config is None:
        raise ComponentError(f"--hub: {job.config.site_dir / HUB_FILE} is missing")
    from .hub_executor import HubExecutor  # gRPC and the SDK: loaded at hub sites only

    return Executors(by_task={ANY_TASK: HubExecutor(config, job.job_id, abort, job.app_dir)})


def work(job: ClientJob, bus: RabbitBus, abort: threading.Event, hub: bool = False) -> bool:
    """Steps 2 and 3; True after END_RUN, False once `abort` stopped it. Raises what ended the
    worker (FedhiveError: one line for the operator)."""
    try:
        executors = executors_for(job, hub, abort)
    except ComponentError as err:
        job.log.error("client_job.bad_executor_config", error=str(err))
        _exit_notice(job, bus, str(err))
        raise
    worker = Worker(bus, executors, WorkerConfig(
        job_id=job.job_id, site=job.config.site, server_queue=job.server_queue,
        workspace=job.app_dir, inline_threshold=job.settings.inline_threshold,
    ), abort=abort, log=job.log)
    failure: list[BaseException] = []
    ended = threading.Event()

    def loop() -> None:
        try:
            worker.run()
        except BaseException as err:  # handed to the main thread
            failure.append(err)
        finally:
            ended.set()

    thread = threading.Thread(target=loop, name="worker", daemon=True)
    thread.start()
    interval = job.config.heartbeat_interval_s
    next_beat = time.monotonic() + interval
    # Woken by the worker's end, else once a beat or ABORT_CHECK_S: in a host of 100 light
    # sites each wake is a turn at one GIL among ~1,200 threads (0.2 s slices cost ~9 % of it).
    while not ended.is_set() and not abort.is_set():
        ended.wait(min(ABORT_CHECK_S, max(0.0, next_beat - time.monotonic())))
        if time.monotonic() >= next_beat and not ended.is_set():
            next_beat += interval
            try:
                beat(job, bus, worker.current_task)
            except FedhiveError as err:  # the broker away for a moment: the next beat retries
                job.log.warning("client_job.beat_failed", error=str(err))
    if abort.is_set():
        # Give the running task a moment to see the abort, well inside the agent's grace.
        thread.join(min(5.0, job.config.abort_grace_s / 2))
        job.log.info("client_job.stopped", task=worker.current_task)
        return False
    if failure:
        raise failure[0]
    return True


def _exit_notice(job: ClientJob, bus: RabbitBus, error: str) -> None:
    try:
        send_worker_exit(bus, job.server_queue, job.job_id, job.config.site, error)
    except FedhiveError as err:
        job.log.warning("client_job.exit_notice_failed", error=str(err))


def last_words(job: ClientJob | None, exit_code: int, reason: str) -> None:
    """Leave the agent `exit_code` and `reason`; without a job (its site folder unreadable)
    there is nowhere to: the agent falls back on the exit status and the log."""
    if job is None:
        return
    words = LastWords(exit_code, one_line(reason))
    try:
        Workspace(job.config.workspace).save_last_words(job.job_id, words)
    except OSError as err:
        job.log.warning("client_job.last_words_failed", error=str(err))


def serve(job: ClientJob, args: argparse.Namespace, abort: threading.Event,
          environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Steps 1 to 3 on the job's own connection: (exit code, why) for its last words."""
    bus = RabbitBus(job.settings, name=f"client-job.{job.job_id}", site=True)
    try:
        report(job, args, bus, environ)
        ended = work(job, bus, abort, args.hub)
    finally:
        bus.close()
    if not ended:
        return -signal.SIGTERM, "stopped by SIGTERM, its running task given a moment"
    job.log.info("client_job.ended")
    return 0, "the server job ended the run"


def main(argv: list[str] | None = None) -> None:
    bound_heap()  # before any thread: see fedhive.heap
    abort = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: abort.set())
    args = parse_args(argv)
    job: ClientJob | None = None
    try:
        job = prepare(args)
        code, why = serve(job, args, abort)
    except (FedhiveError, ComponentError) as err:
        last_words(job, 1, str(err))
        print(f"fedhive-client-job: {err}", file=sys.stderr)
        sys.exit(1)
    except Exception as err:  # a bug: its traceback goes to the log, its last line to the runner
        last_words(job, 1, f"{type(err).__name__}: {err}")
        raise
    last_words(job, code, why)
    if code < 0:  # stopped: end as SIGTERM would have, the running task given its moment
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(0)


def run_in_thread(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log_file: Path,
                  abort: threading.Event) -> int:
    """`main` as a thread of a light-site host: the exit code is returned, never raised."""
    args = parse_args(list(argv))
    job: ClientJob | None = None
    with log_file.open("a", buffering=1) as out:
        try:
            job = prepare(args, environ=env, app_dir=cwd, log_stream=out)
            code, why = serve(job, args, abort, env)
        except Exception as err:  # a thread's end must be told, whatever ended it
            why = str(err) if isinstance(err, FedhiveError | ComponentError) \
                else f"{type(err).__name__}: {err}"
            print(f"fedhive-client-job: {why}", file=out)
            last_words(job, 1, why)
            return 1
        last_words(job, code, why)
        return code


if __name__ == "__main__":
    main()
