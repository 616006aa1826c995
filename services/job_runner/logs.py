"""The job-runner's log intake: sites' `LogBatch`es into the jobs' logs (`fedhive.joblogs`).

Consumes `site.*.logs` on the events queue `Names.events_queue("logs")` (shared by every
job-runner replica), one message at a time, and stores a batch only when

* its sender is the site it names: the broker-verified `user_id` is the broker user of the
  routing key's site and the payload names that site (`fedhive.joblogs.intake.accept`), and
* the job was deployed to that site: its record's `site_states` say so, or the site is one of
  the job's `sites` (a job of another site, or no job at all, is refused).

A refused batch is dropped (acked; a dead-letter queue would only let a misbehaving site fill
it) with one warning line naming the sender, the claimed site and the job: a hostile site can
neither write into another job's logs nor speak as another site. A batch marked `private` (the
site turned sharing off) records only that the site does not share its logs.

Storing is `JobLogStore.append`: a line already stored is skipped, so a batch delivered twice
(or sent again by a restarted agent) is stored once. Redis away raises: the batch is requeued.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from google.protobuf.message import Message

from fedhive.bus import Bus, Delivery, Senders, Subscription
from fedhive.errors import MalformedMessage, NotFound, PermissionDenied
from fedhive.joblogs import intake
from fedhive.joblogs.wire import CLIENT_JOB
from fedhive.jobs.record import JobRecord
from fedhive.proto.v1 import site_pb2
from fedhive.state import JobStore
from fedhive.state.joblogs import PRIVATE, JobLogStore

CONSUMER = "logs"
PREFETCH = 16
KNOWN_JOBS = 1024  # jobs whose deployed sites are remembered (a record read per miss)


def deployed_sites(record: JobRecord) -> frozenset[str]:
    """The sites the job was deployed to (or ran on)."""
    deployed = {site for site, state in record.site_states.items()
                if isinstance(state, dict) and state.get("deployed")}
    return frozenset(deployed | set(record.sites))


class LogIntake:
    """Started by `start()`, stopped by `close()`; the bus and the stores belong to the caller."""

    def __init__(self, bus: Bus, jobs: JobStore, logs: JobLogStore, log: Any) -> None:
        self._bus = bus
        self._names = bus.names
        self._jobs = jobs
        self._logs = logs
        self._log = log.bind(component="log-intake")
        self._consumer: Subscription | None = None
        self._known: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._consumer = self._bus.subscribe(
            CONSUMER, [intake.PATTERN], self.handle, [site_pb2.LogBatch],
            senders=Senders.any_site(self._names), prefetch=PREFETCH)
        self._log.info("log_intake.started")

    @property
    def subscription(self) -> Subscription | None:
        """Its consumer, once started (the runner's readiness check)."""
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.stop()

    def handle(self, message: Message, delivery: Delivery) -> None:
        assert isinstance(message, site_pb2.LogBatch)  # the bus filters types
        try:
            batch = intake.accept(message, delivery.routing_key, delivery.user_id, self._names)
            self._check_deployed(batch.job_id, batch.site)
        except (PermissionDenied, MalformedMessage, NotFound) as err:
            self._log.warning("job_logs_refused", security=True, sender=delivery.user_id,
                              routing_key=delivery.routing_key, job_id=message.job_id[:128],
                              claimed_site=message.site[:100], code=err.code, error=str(err))
            return
        if batch.private:
            self._logs.mark(batch.job_id, batch.site, PRIVATE)
            return
        stored = self._logs.append(batch.job_id, batch.site, CLIENT_JOB, batch.start,
                                   batch.lines, eof=batch.eof)
        if stored is None:
            self._log.info("job_logs_dropped", job_id=batch.job_id, site=batch.site,
                           why="the job was deleted")

    def _check_deployed(self, job_id: str, site: str) -> None:
        """PermissionDenied unless the job was deployed to `site`; NotFound for no such job."""
        with self._lock:
            sites = self._known.get(job_id)
        if sites is None or site not in sites:  # the deployment may be newer than what we saw
            sites = deployed_sites(self._jobs.get_job(job_id))
            with self._lock:
                self._known[job_id] = sites
                self._known.move_to_end(job_id)
                while len(self._known) > KNOWN_JOBS:
                    self._known.popitem(last=False)
        if site not in sites:
            raise PermissionDenied(f"site {site!r} sent log lines for job {job_id}, which was "
                                   "not deployed to it", field="job_id")
