"""The site's heartbeat: a `SiteHeartbeat` on `site.<site>.heartbeat` every N seconds (and one
at once), `site.<site>.online` at start and `site.<site>.offline` on a clean shutdown.

A failed publish (broker unreachable for longer than the publisher retries) is logged and the
next beat tried on schedule: a heartbeat is only ever as good as the latest one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

import fedhive
from fedhive.bus import Bus
from fedhive.errors import FedhiveError
from fedhive.names import Names
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.sites.serde import site_heartbeat_to_proto

from .agent import SiteAgent

log = structlog.get_logger()


def site_heartbeat(agent: SiteAgent, clock: Callable[[], float] = time.time) -> SiteHeartbeat:
    return SiteHeartbeat(
        site=agent.config.site,
        org=agent.config.org,
        running_job_ids=agent.running_job_ids(),
        resources=agent.report_resources(),
        agent_version=fedhive.__version__,
        sent_at_ms=int(clock() * 1000),
    )


class Heartbeats:
    def __init__(self, agent: SiteAgent, bus: Bus) -> None:
        self._agent = agent
        self._bus = bus
        self._site = agent.config.site
        self._interval = agent.config.heartbeat_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="site-heartbeat", daemon=True)
        self._log = log.bind(site=self._site)

    def start(self) -> None:
        """Announce the site (`online`, published before returning) and start beating."""
        self.publish("online")
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and announce `offline`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.publish("offline")

    def publish(self, kind: str) -> bool:
        beat = site_heartbeat_to_proto(site_heartbeat(self._agent))
        try:
            self._bus.publish_event(Names.site_event(self._site, kind), beat)
        except FedhiveError as err:
            self._log.warning("site_agent.heartbeat_failed", kind=kind, error=str(err))
            return False
        return True

    def _run(self) -> None:
        while True:
            self.publish("heartbeat")
            if self._stop.wait(self._interval):
                return
