"""The scheduler's ports on the bus: site resource checks and the job-runner link."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedhive.bus import Bus
from fedhive.errors import FedhiveError
from fedhive.jobs.record import JobRecord, JobStatusEvent
from fedhive.jobs.serde import event_to_proto
from fedhive.names import Names
from fedhive.proto.v1 import runner_pb2, site_pb2
from fedhive.scheduling import SiteAnswer
from fedhive.structs import dict_to_struct

RUNNER_SERVICE = "job-runner"
CANCEL_TIMEOUT_S = 5.0


class BusSiteResources:
    """check_resources / cancel_resources on the sites' control queues, all sites at once."""

    def __init__(self, bus: Bus, names: Names, log: Any) -> None:
        self._bus = bus
        self._names = names
        self._log = log

    def check(
        self, job_id: str, requirements: Mapping[str, dict[str, Any]], timeout_s: float
    ) -> dict[str, SiteAnswer]:
        queues = {self._names.site_queue(site): site for site in requirements}
        requests = {
            queue: site_pb2.CheckResourcesRequest(
                job_id=job_id, requirement=dict_to_struct(requirements[site]))
            for queue, site in queues.items()
        }
        replies = self._bus.call_many(requests, site_pb2.CheckResourcesReply, timeout=timeout_s)
        answers: dict[str, SiteAnswer] = {}
        for queue, reply in replies.items():
            site = queues[queue]
            if isinstance(reply, FedhiveError):  # timeout, unroutable or the site's error: no
                answers[site] = SiteAnswer(ok=False, reason=f"{reply.code}: {reply}")
            else:
                answers[site] = SiteAnswer(ok=reply.ok, token=reply.token, reason=reply.reason)
        return answers

    def cancel(self, job_id: str, reservations: Mapping[str, str]) -> None:
        if not reservations:
            return
        requests = {self._names.site_queue(site): site_pb2.CancelResourcesRequest(token=token)
                    for site, token in reservations.items()}
        replies = self._bus.call_many(requests, site_pb2.CancelResourcesReply,
                                      timeout=CANCEL_TIMEOUT_S)
        for queue, reply in replies.items():
            if isinstance(reply, FedhiveError):  # the reservation expires on the site
                self._log.warning("scheduler.cancel_failed", job_id=job_id, queue=queue,
                                  error=str(reply))


class BusRunnerLink:
    """Durable DispatchJob commands to the job-runner, status events to everyone."""

    def __init__(self, bus: Bus, names: Names) -> None:
        self._bus = bus
        self._queue = names.service_queue(RUNNER_SERVICE)

    def dispatch(self, record: JobRecord, fence_token: int) -> None:
        command = runner_pb2.DispatchJob(
            job_id=record.job_id, fence_token=fence_token,
            sites=[runner_pb2.SiteReservation(site=site, token=record.reservations[site])
                   for site in record.sites],
        )
        # one id per dispatch of the job: a re-sent command is recognisable as the same one
        self._bus.send(self._queue, command,
                       message_id=f"dispatch:{record.job_id}:{len(record.history)}")

    def announce(self, record: JobRecord) -> None:
        change = record.history[-1]
        self._bus.publish_event(
            Names.job_status_event(change.to_status.value),
            event_to_proto(JobStatusEvent(record.job_id, change)),
            message_id=f"{record.job_id}:{len(record.history)}",
        )
