"""The server-job process (SJ): runs one job's server app.

`python -m fedhive.fl.server_job --job-id ID --app-dir APP --workspace WS --site S ...` (the
job-runner starts it, in its own process group, with the FEDHIVE_* environment):

1. renews its liveness record in Redis every `--liveness-interval` seconds (`RunTable.beat`),
   so any runner (not only its parent) can tell it is alive;
2. serves `Names.job_server_queue(job_id)` on its own broker connection: `SiteGone` from the
   runner is handed to the workflows (`WorkflowContext.gone_sites`);
3. loads `APP/config/config_fed_server.json`, builds its `components` then its `workflows` by
   import path with their args (`APP/custom` is on sys.path), and runs the workflows in order
   (see `fedhive.fl.workflow`);
4. reports its outcome in Redis (`RunTable.report`): `completed`, or `exception` with the
   error — a component that cannot be built is an exception naming the component id.

SIGTERM sets the workflows' abort event; the process reports and exits once they return.
Exit code 0 when completed, 1 after an exception, 2 for bad arguments or settings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from fedhive.bus import Delivery, RabbitBus
from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.fl.workflow import WorkflowContext
from fedhive.logging import configure
from fedhive.names import Names
from fedhive.proto.v1 import runner_pb2
from fedhive.state.runs import Outcome, RunTable

SERVER_CONFIG = "config/config_fed_server.json"


class ComponentError(Exception):
    """A component that cannot be built; the message names its id."""


def build_component(spec: Any, where: str, components: dict[str, Any]) -> Any:
    """The object a `{id, path, args}` entry describes; nested `{path, args}` values in args
    are built first. ComponentError naming the component on a bad path or argument."""
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise ComponentError(f"{where}: must be an object with a 'path'")
    label = f"component {spec['id']!r}" if spec.get("id") else where
    module_name, _, class_name = spec["path"].rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ComponentError(f"{label}: cannot import {spec['path']!r}: {err}") from None
    args = spec.get("args", {})
    if not isinstance(args, dict):
        raise ComponentError(f"{label}: args must be an object")
    built = {
        name: build_component(value, f"{label} arg {name!r}", components)
        if isinstance(value, dict) and "path" in value else value
        for name, value in args.items()
    }
    try:
        instance = target(**built)
    except TypeError as err:
        raise ComponentError(f"{label}: bad arguments for {spec['path']}: {err}") from None
    except Exception as err:
        raise ComponentError(
            f"{label}: {spec['path']} raised {type(err).__name__}: {err}") from err
    if spec.get("id"):
        components[spec["id"]] = instance
    return instance


def run_app(app_dir: Path, ctx: WorkflowContext) -> None:
    """Build the app's components and workflows, run the workflows in order; raises what a
    component or workflow raised."""
    custom = app_dir / "custom"
    if custom.is_dir():
        sys.path.insert(0, str(custom))
    config = json.loads((app_dir / SERVER_CONFIG).read_text())
    for index, spec in enumerate(config.get("components", [])):
        build_component(spec, f"components[{index}]", ctx.components)
    workflows = [
        build_component(spec, f"workflows[{index}]", ctx.components)
        for index, spec in enumerate(config.get("workflows", []))
    ]
    for workflow in workflows:
        if ctx.abort.is_set():
            return
        ctx.log.info("server_job.workflow", workflow=type(workflow).__name__)
        workflow.run(ctx)


def _liveness(table: RunTable, ctx: WorkflowContext, interval: float, stop: threading.Event,
              ) -> None:
    while not stop.is_set():
        try:
            table.beat(ctx.job_id, os.getpid(), ttl_s=interval * 4)
        except Exception as err:  # Redis away for a moment: the next beat tries again
            ctx.log.warning("server_job.beat_failed", error=str(err))
        stop.wait(interval)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedhive-server-job",
                                     description="Run one job's server app (started by the "
                                     "job-runner).")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--app-dir", required=True, type=Path)
    parser.add_argument("--workspace", required=True, type=Path)
    parser.add_argument("--site", action="append", default=[], dest="sites")
    parser.add_argument("--liveness-interval", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings.from_env()
    except FedhiveError as err:
        print(f"fedhive-server-job: {err}", file=sys.stderr)
        return 2
    log = configure("server-job", level=settings.log_level).bind(job_id=args.job_id)
    args.workspace.mkdir(parents=True, exist_ok=True)
    ctx = WorkflowContext(job_id=args.job_id, sites=list(args.sites),
                          workspace=args.workspace, log=log)
    signal.signal(signal.SIGTERM, lambda *_: ctx.abort.set())
    table = RunTable.from_settings(settings)
    stop = threading.Event()
    beats = threading.Thread(target=_liveness, args=(table, ctx, args.liveness_interval, stop),
                             name="liveness", daemon=True)
    beats.start()
    bus = RabbitBus(settings, name=f"server-job.{args.job_id}")

    def on_site_gone(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, runner_pb2.SiteGone)
        if message.job_id == args.job_id:
            log.warning("server_job.site_gone", site=message.site, reason=message.reason)
            ctx.site_gone(message.site, message.reason)

    try:
        bus.serve(Names(settings.namespace).job_server_queue(args.job_id), on_site_gone,
                  [runner_pb2.SiteGone])
        log.info("server_job.started", pid=os.getpid(), sites=ctx.sites)
        run_app(args.app_dir, ctx)
        outcome = Outcome("completed")
    except Exception as err:
        log.error("server_job.exception", error=f"{type(err).__name__}: {err}")
        outcome = Outcome("exception", f"{type(err).__name__}: {err}")
    stop.set()
    beats.join()
    table.report(args.job_id, outcome)
    log.info("server_job.ended", result=outcome.result, aborted=ctx.abort.is_set())
    bus.close()
    table.close()
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
