"""`fedhive-site-agent`: one site: resources, heartbeats, client jobs.

    fedhive-site-agent [run] --site-dir DIR          run the agent until SIGTERM/SIGINT
    fedhive-site-agent status --site-dir DIR [--json] the site's jobs, from its own files
    fedhive-site-agent host --site-dir DIR ... | --sites-root ROOT
                                                     many light sites in one process

A light-site host runs one agent per site folder (every `ROOT/*/` with a `local/site.json`),
each exactly as `run` would (its own broker user and connection, control queue, heartbeats,
notices, logs), but runs client jobs as threads (`launch.Threads`): a site costs a few MiB
instead of a process per job, so hundreds of sites fit on one machine for tests and benchmarks.
Not for production: threads cannot be killed, and share one environment (resource variables are
not applied) and one failure domain. A hub site cannot be hosted (one line, exit 2).

The composition root: the site folder gives the site's config and resources (a bad file stops
the start with one line naming file and field, exit 2), the agent reconciles its workspace
(re-adopting the client jobs that outlived an earlier agent), then serves its control queue
`{ns}.site.<site>` (declared with the site's broker user, which may declare nothing: a missing
queue stops the start with one line saying how to provision the site), heartbeats, publishes
ended client jobs' notices and shares their logs (`logs.py`, unless site.json says
`share_logs: false`). A clean shutdown stops consuming, aborts running client jobs, publishes
their notices and last log lines, announces `offline` and closes the bus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedhive.bus import Consumer, RabbitBus, Senders
from fedhive.config import Settings
from fedhive.errors import ConfigError, FedhiveError
from fedhive.names import Names
from fedhive.readiness import STALE_AFTER, Check
from fedhive.readiness_checks import consuming, published_within
from fedhive.service import run

from . import process
from .agent import SiteAgent
from .config import agent_settings, load_site, load_site_resources
from .handlers import ACCEPTS, make_handler
from .heartbeat import EndedNotices, Heartbeats
from .hub_config import HUB_FILE, load_hub
from .launch import Threads
from .logs import LogShipper
from .records import AgentInfo, Workspace, now_ms
from .status import render, site_status

SERVICE = "site-agent"
HOST_SERVICE = "site-host"
# Commands run concurrently (each job's commands one at a time): an abort waiting out its
# grace period must not hold up other jobs' checks and deploys.
CONCURRENCY = 4


class RunningAgent:
    def __init__(self, agent: SiteAgent, bus: RabbitBus, workspace: Workspace) -> None:
        self.agent = agent
        self._bus = bus
        self._ws = workspace
        previous = workspace.load_agent()
        self._info = AgentInfo(
            site=agent.config.site,
            pid=os.getpid(),
            pid_started=process.start_time(os.getpid()),
            started_at_ms=now_ms(),
            last_server_contact_ms=previous.last_server_contact_ms if previous else 0,
        )
        workspace.save_agent(self._info)
        self._heartbeats = Heartbeats(agent, bus)
        self._notices = EndedNotices(agent, bus)
        self._logs = LogShipper(agent, workspace, bus)
        self._control: Consumer | None = None

    def start(self) -> None:
        queue = Names(self.agent.config.namespace).site_queue(self.agent.config.site)
        handler = make_handler(self.agent, self._contact)
        self._control = self._bus.serve(
            queue, handler, ACCEPTS, concurrency=CONCURRENCY,
            senders=Senders.only(self.agent.config.services_user))
        self._heartbeats.start()
        self._notices.start()
        self._logs.start()

    def ready_checks(self) -> list[Check]:
        """Its control queue consumed, its heartbeats reaching the broker."""
        assert self._control is not None  # asked only of a started agent
        within = STALE_AFTER * self.agent.config.heartbeat_interval_s
        return [consuming(self._control),
                published_within("heartbeats", lambda: self._heartbeats.last_confirmed,
                                 within, "heartbeat")]

    def _contact(self) -> None:
        self._info = replace(self._info, last_server_contact_ms=now_ms())
        self._ws.save_agent(self._info)

    def close(self) -> None:
        if self._control is not None:
            self._control.stop()
        self.agent.shutdown()
        self._notices.stop()
        self._logs.stop()
        self._heartbeats.stop()
        self._bus.close()
        if self.agent.hub is not None:
            self.agent.hub.close()


def build_agent(site_dir: Path, settings: Settings, log: Any, *,
                light: bool = False) -> RunningAgent:
    """The site's agent, started; `light`: its client jobs run as threads (a host's site)."""
    config = load_site(site_dir)
    resources = load_site_resources(config)
    workspace = Workspace(config.workspace)
    if light and (config.site_dir / HUB_FILE).exists():
        raise ConfigError(f"{config.site_dir / HUB_FILE}: a hub site cannot be a light site",
                          field="hub")
    hub_config = load_hub(config.site_dir)
    hub = None
    if hub_config is not None:
        from .hub import Hub  # gRPC and the SDK: loaded by hub sites only

        hub = Hub(hub_config, config.site)
        try:
            hub.verify()
        except BaseException:
            hub.close()
            raise
    agent = SiteAgent(config, resources, workspace, hub=hub,
                      launcher=Threads() if light else None)
    agent.reconcile()
    bus = RabbitBus(agent_settings(settings, config), name=f"{SERVICE}.{config.site}", site=True)
    try:
        running = RunningAgent(agent, bus, workspace)
        running.start()
    except BaseException:
        bus.close()
        raise
    log.bind(site=config.site).info(
        "site_agent.ready", namespace=config.namespace, workspace=str(config.workspace),
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    return running


class Host:
    """Light sites: one `RunningAgent` per site folder, client jobs as threads."""

    def __init__(self, agents: list[RunningAgent]) -> None:
        self.agents = agents

    def ready_checks(self) -> list[Check]:
        return [check for agent in self.agents for check in agent.ready_checks()]

    def close(self) -> None:
        with ThreadPoolExecutor(BUILDERS) as pool:  # each waits out its jobs' abort grace
            list(pool.map(RunningAgent.close, self.agents))


BUILDERS = 16  # agents connected and closed at once: each is a broker round trip or more


def build_host(site_dirs: list[Path], settings: Settings, log: Any) -> Host:
    """Every site's agent, started; a site that cannot start stops them all (its error)."""
    started: list[RunningAgent] = []
    with ThreadPoolExecutor(BUILDERS) as pool:
        futures = [pool.submit(build_agent, site_dir, settings, log, light=True)
                   for site_dir in site_dirs]
        errors = []
        for future in futures:
            try:
                started.append(future.result())
            except BaseException as err:  # the others are stopped, this one is told
                errors.append(err)
    if errors:
        Host(started).close()
        raise errors[0]
    log.info("site_host.ready", sites=len(started))
    return Host(started)


def site_folders(args: argparse.Namespace) -> list[Path]:
    """`--site-dir`s, or every folder of `--sites-root` with a `local/site.json`."""
    if args.sites_root is None:
        return list(args.site_dirs)
    folders = sorted(p.parent.parent for p in args.sites_root.glob("*/local/site.json"))
    if not folders:
        raise ConfigError(f"{args.sites_root}: no site folder (*/local/site.json) in it",
                          field="sites_root")
    return folders


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fedhive-site-agent",
        description="fedhive site agent: one site: resources, heartbeats, client jobs.",
    )
    commands = parser.add_subparsers(dest="command")
    run_cmd = commands.add_parser("run", help="run the site agent (the default)")
    status = commands.add_parser("status", help="print the site's jobs and last server contact")
    for sub in (parser, run_cmd, status):
        sub.add_argument("--site-dir", type=Path, required=sub is not parser,
                         help="the site folder (with local/site.json and local/resources.json)")
    status.add_argument("--json", action="store_true", help="print JSON")
    host = commands.add_parser("host", help="run many light sites in this process (tests and "
                               "benchmarks at scale)")
    sites = host.add_mutually_exclusive_group(required=True)
    sites.add_argument("--site-dir", type=Path, action="append", dest="site_dirs",
                       help="a site folder (repeatable)")
    sites.add_argument("--sites-root", type=Path,
                       help="a folder whose every */local/site.json is a site")
    args = parser.parse_args(argv)
    if args.command != "host" and args.site_dir is None:
        parser.error("--site-dir is required")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "status":
        try:
            status = site_status(args.site_dir)
        except FedhiveError as err:
            print(f"fedhive-site-agent: {err}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(status.to_json(), indent=2) if args.json else render(status))
        return
    if args.command == "host":
        run(HOST_SERVICE, lambda settings, log: build_host(site_folders(args), settings, log))
    run(SERVICE, lambda settings, log: build_agent(args.site_dir, settings, log))


if __name__ == "__main__":
    main()
