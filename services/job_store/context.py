"""What the job-store's handlers are given: the ports they use, and the status-event helper."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf.message import Message

from fedhive.blobs import BlobStore
from fedhive.errors import NotFound
from fedhive.jobs.archive import ArchiveLimits
from fedhive.jobs.record import JobRecord, JobStatusEvent
from fedhive.jobs.serde import event_to_proto
from fedhive.names import Names
from fedhive.state import StateStore


class EventPublisher(Protocol):
    """The part of the bus port the handlers use (`fedhive.bus.Bus` has it)."""

    def publish_event(
        self, routing_key: str, message: Message, *, message_id: str | None = None
    ) -> str: ...


@dataclass(frozen=True)
class JobStoreContext:
    state: StateStore
    blobs: BlobStore
    events: EventPublisher
    names: Names
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)


def publish_status(ctx: JobStoreContext, record: JobRecord) -> None:
    """Publish the record's latest status change as `job.status.<status>`.

    The message id is `<job_id>:<history length>`: the same change always has the same id, so
    a change published again after a redelivery can be recognised by subscribers.
    """
    change = record.history[-1]
    ctx.events.publish_event(
        Names.job_status_event(change.to_status.value),
        event_to_proto(JobStatusEvent(record.job_id, change)),
        message_id=f"{record.job_id}:{len(record.history)}",
    )


def job_id_for(namespace: str, message_id: str | None) -> str:
    """The id of the job a request creates: a uuid4-form string derived from the bus message id,
    so a redelivered request (same message id) names the same job. Without a message id (a
    foreign publisher), a random uuid4."""
    if not message_id:
        return str(uuid.uuid4())
    digest = hashlib.sha256(f"{namespace}\0{message_id}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def find_job(ctx: JobStoreContext, job_id: str) -> JobRecord | None:
    try:
        return ctx.state.get_job(job_id)
    except NotFound:
        return None
