"""The site's heartbeats: a `SiteHeartbeat` on `site.<site>.heartbeat` every N seconds (and one
at once), `site.<site>.online` at start and `site.<site>.offline` on a clean shutdown; and, on
`site.<site>.job`, the final `JobHeartbeat` (`ended`) of every client job whose process ended.

A failed site heartbeat (broker unreachable for longer than the publisher retries) is logged
and the next beat tried on schedule: a heartbeat is only ever as good as the latest one. An
ended notice is not: the runner acts on it, and nothing else tells it of a client job that died
before its first beat. It stays pending in the job's record file until the broker confirmed
it, is retried while the broker is away, and a restarted agent publishes what is still pending.
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
from fedhive.retry import Backoff
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import job_heartbeat_to_proto, site_heartbeat_to_proto

from .agent import SiteAgent
from .records import JobRecord, JobState, one_line

log = structlog.get_logger()

# The notice's exit_code when the exit status is not known (a client job that ended while it
# was not the agent's child, without last words): containerd's "unknown exit status".
UNKNOWN_EXIT_CODE = 255
# Between rounds of publishing pending notices while the broker refuses them (each publish
# already retries a lost connection for a while: `fedhive.bus.publisher`).
NOTICE_RETRY = Backoff(base=1.0, cap=30.0, max_attempts=None)


def site_heartbeat(agent: SiteAgent, clock: Callable[[], float] = time.time) -> SiteHeartbeat:
    sent_at_ms = int(clock() * 1000)  # before the jobs are listed: a job started later is not
    return SiteHeartbeat(
        site=agent.config.site,
        org=agent.config.org,
        running_job_ids=agent.running_job_ids(),
        resources=agent.report_resources(),
        agent_version=fedhive.__version__,
        sent_at_ms=sent_at_ms,
    )


def ended_notice(record: JobRecord, site: str, clock: Callable[[], float] = time.time,
                 ) -> JobHeartbeat:
    """The final JobHeartbeat of a job whose client job ended (`record.notice_pending`)."""
    if record.state is JobState.LOST:
        reason = f"{record.reason}: {record.exit_reason}"
    elif record.state is JobState.ABORTED:
        reason = f"{record.exit_reason} (aborted: {record.reason})"
    else:
        reason = record.exit_reason
    return JobHeartbeat(
        job_id=record.job_id,
        site=site,
        sent_at_ms=int(clock() * 1000),
        ended=True,
        exit_code=UNKNOWN_EXIT_CODE if record.exit_code is None else record.exit_code,
        reason=one_line(reason),
    )


def notice_id(job_id: str, site: str) -> str:
    """The message id of a job's ended notice at a site: one id however often it is sent."""
    return f"{job_id}.{site}.ended"


class Heartbeats:
    def __init__(self, agent: SiteAgent, bus: Bus) -> None:
        self._agent = agent
        self._bus = bus
        self._site = agent.config.site
        self._interval = agent.config.heartbeat_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="site-heartbeat", daemon=True)
        self._log = log.bind(site=self._site)
        self.last_confirmed: float | None = None  # time.monotonic() of the last one confirmed

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
        self.last_confirmed = time.monotonic()
        return True

    def _run(self) -> None:
        hub = self._agent.hub
        while True:
            # A hub whose lower tier does not answer has nothing to offer: no heartbeat, so
            # the runner soon sees the site offline and the scheduler does not count on it.
            down = hub.unreachable() if hub is not None else ""
            if down:
                self._log.warning("site_agent.heartbeat_withheld", why=down)
            else:
                self.publish("heartbeat")
            if self._stop.wait(self._interval):
                return


class EndedNotices:
    """Publishes every pending ended notice (`SiteAgent.pending_notices`) whenever the agent
    says one is due, and again after a failure until the broker confirmed it."""

    def __init__(self, agent: SiteAgent, bus: Bus, *, retry: Backoff = NOTICE_RETRY) -> None:
        self._agent = agent
        self._bus = bus
        self._site = agent.config.site
        self._retry = retry
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ended-notices", daemon=True)
        self._log = log.bind(site=self._site)

    def start(self) -> None:
        """Publish what an earlier agent left pending, then whatever becomes due."""
        self._agent.notice_due.set()
        self._thread.start()

    def stop(self) -> None:
        """Stop, after one more try of what is pending (a clean shutdown's aborts end jobs);
        what still fails stays pending for the next start."""
        self._stop.set()
        self._agent.notice_due.set()
        if self._thread.is_alive():
            self._thread.join()
        self.publish_pending()

    def publish_pending(self) -> bool:
        """Publish every pending notice, oldest first; False at the first that fails."""
        for record in sorted(self._agent.pending_notices(), key=lambda r: r.updated_at_ms):
            notice = ended_notice(record, self._site)
            try:
                self._bus.publish_event(Names.site_event(self._site, "job"),
                                        job_heartbeat_to_proto(notice),
                                        message_id=notice_id(record.job_id, self._site))
            except FedhiveError as err:
                self._log.warning("site_agent.notice_failed", job_id=record.job_id,
                                  error=str(err))
                return False
            self._agent.notice_published(record.job_id)
            self._log.info("site_agent.notice_published", job_id=record.job_id,
                           exit_code=notice.exit_code, reason=notice.reason)
        return True

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._agent.notice_due.wait()
            self._agent.notice_due.clear()
            if self._stop.is_set():
                return
            if self.publish_pending():
                failures = 0
                continue
            failures += 1
            if self._stop.wait(self._retry.delay(failures)):
                return
            self._agent.notice_due.set()  # try again
