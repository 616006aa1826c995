"""The client job (CJ): one process per job per site, started by the site agent.

    python -m fedhive_services.site_agent.client_job --site-dir DIR --job-id ID \
        --server-queue QUEUE [--resource-env NAME ...]

Its worker loop (get task, run executor, submit result) arrives with the FL runtime. Until then
it does what every CJ does first and exits 0: it reports itself, proving the plumbing the agent
gives it: its own process (group), the resource consumer's environment (each `--resource-env`
variable's value), the deployed app as its working directory, and the site's broker identity
(its `JobHeartbeat` on `site.<site>.job` carries the site's AMQP user_id). The same facts go to
`<workspace>/.agent/jobs/<job_id>.cj.json` for the site operator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pika

from fedhive.bus import RabbitBus
from fedhive.config import Settings, environment_values
from fedhive.errors import FedhiveError
from fedhive.logging import configure
from fedhive.names import Names
from fedhive.sites.heartbeat import JobHeartbeat
from fedhive.sites.serde import job_heartbeat_to_proto

from .config import agent_settings, load_site
from .records import Workspace, check_job_id, now_ms, write_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedhive-client-job", description=__doc__)
    parser.add_argument("--site-dir", type=Path, required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--server-queue", default="")
    parser.add_argument("--resource-env", action="append", default=[],
                        help="a variable the resource consumer set (reported back)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    base = Settings.from_env()
    config = load_site(args.site_dir)
    job_id = check_job_id(args.job_id)
    log = configure("client-job", level=base.log_level).bind(site=config.site, job_id=job_id)
    settings = agent_settings(base, config)
    report = {
        "job_id": job_id,
        "site": config.site,
        "pid": os.getpid(),
        "process_group": os.getpgid(0),
        "cwd": str(Path.cwd()),
        "server_queue": args.server_queue,
        "resource_env": environment_values(args.resource_env),
        "broker_user": pika.URLParameters(settings.amqp_url).credentials.username,
        "started_at_ms": now_ms(),
    }
    write_json(Workspace(config.workspace).report_file(job_id), report)
    bus = RabbitBus(settings, name=f"client-job.{job_id}", sign=True)
    try:
        beat = JobHeartbeat(job_id=job_id, site=config.site, sent_at_ms=int(time.time() * 1000),
                            current_task="started", progress=0.0)
        bus.publish_event(Names.site_event(config.site, "job"), job_heartbeat_to_proto(beat))
    finally:
        bus.close()
    log.info("client_job.reported", resource_env=report["resource_env"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except FedhiveError as err:
        print(f"fedhive-client-job: {err}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
