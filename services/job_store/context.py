"""What the job-store's handlers are given: the ports they use, and the status-event helper."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf.message import DecodeError, EncodeError

from fedhive.blobs import BlobStore
from fedhive.errors import NotFound
from fedhive.jobs import events
from fedhive.jobs.archive import ArchiveLimits
from fedhive.jobs.record import JobRecord
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2
from fedhive.state import StateStore

# What a handler raises for an input it cannot handle (a value out of range for its wire type,
# nesting past the interpreter's limit, ...): retrying cannot help, so the request is answered
# with an error at once instead of being redelivered until it is dead-lettered.
DATA_ERRORS: tuple[type[Exception], ...] = (
    ValueError, TypeError, RecursionError, EncodeError, DecodeError,
)


class RunnerCaller(Protocol):
    """The part of the bus port that reaches the job-runner (`fedhive.bus.Bus` has it)."""

    def call(
        self, queue: str, request: admin_pb2.AbortJobRequest,
        reply_type: type[job_pb2.JobRecord], *, timeout: float,
    ) -> job_pb2.JobRecord: ...


class RoundReader(Protocol):
    """The read side of the job's round log (`fedhive.state.rounds.RoundLog` has it)."""

    def read(self, job_id: str) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class JobStoreContext:
    state: StateStore
    blobs: BlobStore
    events: events.EventPublisher
    runner: RunnerCaller  # aborts of DISPATCHED/RUNNING jobs are the job-runner's
    names: Names
    rounds: RoundReader  # the per-round metrics server jobs record
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)


def publish_status(ctx: JobStoreContext, record: JobRecord) -> None:
    events.publish_status(ctx.events, record)


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
