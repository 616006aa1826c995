"""`fedhive-job-runner`: deploys, starts, monitors and finishes jobs.

Its first duty is the heartbeat intake and site registry (`heartbeats.py`); running jobs
arrives with issue 6 beside it. Configured by the FEDHIVE_* environment (`Settings`) plus the
liveness options below.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from typing import Any

from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.service import run
from fedhive.sites.intake import IntakeConfig
from fedhive.state import RedisStateStore

from .heartbeats import HeartbeatIntake

SERVICE = "job-runner"


class JobRunner:
    """The composition of the running service; `close()` stops it in reverse order."""

    def __init__(self, bus: RabbitBus, state: RedisStateStore, heartbeats: HeartbeatIntake):
        self.bus = bus
        self.state = state
        self.heartbeats = heartbeats

    def close(self) -> None:
        self.heartbeats.close()
        self.bus.close()
        self.state.close()


def build(settings: Settings, log: Any, *, config: IntakeConfig) -> JobRunner:
    state = RedisStateStore.from_settings(settings)
    bus = RabbitBus(settings, name=SERVICE, sign=True)
    heartbeats = HeartbeatIntake(bus, state, config, log)
    try:
        heartbeats.start()
    except BaseException:
        heartbeats.close()
        bus.close()
        state.close()
        raise
    return JobRunner(bus, state, heartbeats)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def parse_args(argv: Sequence[str] | None = None) -> IntakeConfig:
    defaults = IntakeConfig()
    parser = argparse.ArgumentParser(
        prog="fedhive-job-runner",
        description="fedhive job-runner: heartbeat intake and site registry (running jobs "
        "arrives with issue 6). Broker, Redis and namespace come from FEDHIVE_* variables.",
    )
    parser.add_argument("--site-ttl", type=_positive, default=defaults.site_ttl_s,
                        metavar="SECONDS",
                        help="a site is offline this long after its last heartbeat "
                        "(default %(default)s: 3 x the agents' 5 s interval)")
    parser.add_argument("--job-ttl", type=_positive, default=defaults.job_ttl_s,
                        metavar="SECONDS", help="lifetime of a client job's last heartbeat "
                        "(default %(default)s)")
    parser.add_argument("--sweep-interval", type=_positive, default=defaults.sweep_interval_s,
                        metavar="SECONDS", help="how often expired sites are looked for "
                        "(default %(default)s)")
    args = parser.parse_args(argv)
    return IntakeConfig(site_ttl_s=args.site_ttl, job_ttl_s=args.job_ttl,
                        sweep_interval_s=args.sweep_interval)


def main(argv: Sequence[str] | None = None) -> None:
    run(SERVICE, partial(build, config=parse_args(argv)))
