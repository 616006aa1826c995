"""What the job-store's handlers are given: the ports they use, and the status-event helper."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf.message import DecodeError, EncodeError

from fedhive.blobs import BlobStore
from fedhive.errors import InvalidArgument, NotFound
from fedhive.jobs import events
from fedhive.jobs.archive import ArchiveLimits
from fedhive.jobs.record import JobRecord
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2
from fedhive.state import StateStore
from fedhive.state.joblogs import LogPage

# What a handler raises for an input it cannot handle (a value out of range for its wire type,
# nesting past the interpreter's limit, ...): retrying cannot help, so the request is answered
# with an error at once instead of being redelivered until it is dead-lettered.
DATA_ERRORS: tuple[type[Exception], ...] = (
    ValueError, TypeError, RecursionError, EncodeError, DecodeError,
)
SHOWN_MATCHES = 5  # ids an ambiguous job-id prefix's error names


class RunnerCaller(Protocol):
    """The part of the bus port that reaches the job-runner (`fedhive.bus.Bus` has it)."""

    def call(
        self, queue: str, request: admin_pb2.AbortJobRequest,
        reply_type: type[job_pb2.JobRecord], *, timeout: float,
    ) -> job_pb2.JobRecord: ...


class RoundReader(Protocol):
    """The read side of the job's round log (`fedhive.state.rounds.RoundLog` has it)."""

    def read(self, job_id: str) -> list[dict[str, Any]]: ...


class LogReader(Protocol):
    """The read side of the jobs' logs (`fedhive.state.joblogs.JobLogStore` has it)."""

    def read(self, job_id: str, *, after: str = "", site: str = "", limit: int = ...
             ) -> LogPage: ...

    def sites(self, job_id: str) -> dict[str, str]: ...

    def last_errors(self, job_id: str) -> dict[str, str]: ...


@dataclass(frozen=True)
class JobStoreContext:
    state: StateStore
    blobs: BlobStore
    events: events.EventPublisher
    runner: RunnerCaller  # aborts of DISPATCHED/RUNNING jobs are the job-runner's
    names: Names
    rounds: RoundReader  # the per-round metrics server jobs record
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    logs: LogReader | None = None  # the jobs' shared log lines (None: none are read)


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


def lookup_job(ctx: JobStoreContext, job_id: str) -> JobRecord:
    """The job a request's `job_id` names: the job with exactly that id, else the one job whose
    id starts with it, ignoring case (as FLARE's job listing matches ids). NotFound naming it
    when none does; InvalidArgument naming it and up to `SHOWN_MATCHES` of the ids when several
    do. The prefix search reads only the job-id index (`StateStore.find_job_ids`)."""
    if not job_id:
        raise InvalidArgument("job_id is required", field="job_id")
    try:
        return ctx.state.get_job(job_id)
    except NotFound:
        matches = ctx.state.find_job_ids(job_id, limit=SHOWN_MATCHES + 1)
        if len(matches) > 1:
            shown = ", ".join(matches[:SHOWN_MATCHES])
            more = ", ..." if len(matches) > SHOWN_MATCHES else ""
            raise InvalidArgument(f"job id prefix {job_id} is ambiguous: it matches {shown}"
                                  f"{more}; give more of the id", field="job_id") from None
        if not matches:
            raise
    return ctx.state.get_job(matches[0])  # NotFound (naming the full id) if deleted meanwhile


def find_job(ctx: JobStoreContext, job_id: str) -> JobRecord | None:
    try:
        return ctx.state.get_job(job_id)
    except NotFound:
        return None
