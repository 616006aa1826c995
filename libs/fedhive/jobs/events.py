"""Publishing a job's status change as `job.status.<STATUS>` (whoever made the change does)."""

from __future__ import annotations

from typing import Protocol

from google.protobuf.message import Message

from fedhive.jobs.record import JobRecord, JobStatusEvent
from fedhive.jobs.serde import event_to_proto
from fedhive.names import Names


class EventPublisher(Protocol):
    """The part of the bus port this needs (`fedhive.bus.Bus` has it)."""

    def publish_event(
        self, routing_key: str, message: Message, *, message_id: str | None = None
    ) -> str: ...


def publish_status(events: EventPublisher, record: JobRecord) -> None:
    """Publish the record's latest status change. The message id is `<job_id>:<history
    length>`: the same change always has the same id, so subscribers recognise a repeat."""
    change = record.history[-1]
    events.publish_event(
        Names.job_status_event(change.to_status.value),
        event_to_proto(JobStatusEvent(record.job_id, change)),
        message_id=f"{record.job_id}:{len(record.history)}",
    )
