"""`fedhive-scheduler`: decides when a job may run (FLARE's DefaultJobScheduler semantics).

Broker, Redis and namespace come from the FEDHIVE_* environment (`Settings`); the scheduling
parameters are the options below. Run several replicas: one leads (Redis lease), the others
wait to take over.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.names import Names
from fedhive.readiness import Check
from fedhive.readiness_checks import broker_link, redis_answers
from fedhive.scheduling import Scheduler, SchedulerConfig
from fedhive.service import count, positive_seconds, run
from fedhive.state import RedisStateStore

from .adapters import RUNNER_SERVICE, BusRunnerLink, BusSiteResources
from .service import LoopConfig, SchedulerService

SERVICE = "scheduler"


class Running:
    def __init__(self, service: SchedulerService, bus: RabbitBus, state: RedisStateStore,
                 settings: Settings):
        self.service, self.bus, self.state, self.settings = service, bus, state, settings

    def ready_checks(self) -> list[Check]:
        """Leader or standby alike: a standby is ready to take over. A standby consumes
        nothing, so the broker check is a connection of its own."""
        name = f"{self.settings.namespace}.{SERVICE}.readiness"
        return [broker_link(self.settings, name), redis_answers(self.settings)]

    def close(self) -> None:
        self.service.close()
        self.bus.close()
        self.state.close()


def _clock_ms() -> int:
    return time.time_ns() // 1_000_000


def build(settings: Settings, log: Any, *, config: SchedulerConfig, loop: LoopConfig) -> Running:
    state = RedisStateStore.from_settings(settings)
    bus = RabbitBus(settings, name=SERVICE)
    try:
        names = Names(settings.namespace)
        bus.declare_queue(names.service_queue(RUNNER_SERVICE))
        scheduler = Scheduler(config, state, BusSiteResources(bus, names, log),
                              BusRunnerLink(bus, names), _clock_ms, log)
        service = SchedulerService(scheduler, state, bus, loop, log)
        service.start()
    except BaseException:
        bus.close()
        state.close()
        raise
    log.info("scheduler.configured", holder=service.holder, **vars(config))
    return Running(service, bus, state, settings)


def parse_args(argv: Sequence[str] | None = None) -> tuple[SchedulerConfig, LoopConfig]:
    d, dl = SchedulerConfig(), LoopConfig()
    parser = argparse.ArgumentParser(
        prog="fedhive-scheduler",
        description="fedhive scheduler: decides when a job may run (FLARE DefaultJobScheduler "
        "semantics). Broker, Redis and namespace come from FEDHIVE_* variables.")
    add = parser.add_argument
    add("--max-jobs", type=count, default=d.max_jobs,
        help="jobs DISPATCHED or RUNNING at once (default %(default)s)")
    add("--max-schedule-count", type=count, default=d.max_schedule_count,
        help="failed tries before FINISHED:CAN_NOT_SCHEDULE (default %(default)s)")
    add("--min-schedule-interval", type=positive_seconds, default=d.min_schedule_interval_s,
        metavar="SECONDS", help="wait after the first failed try; doubles after each "
        "(default %(default)s)")
    add("--max-schedule-interval", type=positive_seconds, default=d.max_schedule_interval_s,
        metavar="SECONDS", help="longest wait between tries (default %(default)s)")
    add("--check-timeout", type=positive_seconds, default=d.check_timeout_s, metavar="SECONDS",
        help="a site that does not answer check_resources in time says no "
        "(default %(default)s)")
    add("--tick", type=positive_seconds, default=dl.tick_s, metavar="SECONDS",
        help="pass interval without wake-up events (default %(default)s)")
    add("--lease-ttl", type=positive_seconds, default=dl.lease_ttl_s, metavar="SECONDS",
        help="leader lease lifetime (default %(default)s)")
    add("--renew-interval", type=positive_seconds, default=dl.renew_interval_s, metavar="SECONDS",
        help="leader lease renewal interval (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        config = SchedulerConfig(
            max_jobs=args.max_jobs, max_schedule_count=args.max_schedule_count,
            min_schedule_interval_s=args.min_schedule_interval,
            max_schedule_interval_s=args.max_schedule_interval,
            check_timeout_s=args.check_timeout)
    except FedhiveError as err:
        parser.error(str(err))
    if args.renew_interval >= args.lease_ttl:
        parser.error("--renew-interval must be shorter than --lease-ttl")
    return config, LoopConfig(args.tick, args.lease_ttl, args.renew_interval)


def main(argv: Sequence[str] | None = None) -> None:
    config, loop = parse_args(argv)
    run(SERVICE, partial(build, config=config, loop=loop))
