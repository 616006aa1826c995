"""`AbortJobRequest` on the runner's queue (the job-store forwards aborts of DISPATCHED and
RUNNING jobs here): the status goes to FINISHED:ABORTED first, by compare-and-set, so a
dispatch in progress loses its own DISPATCHED -> RUNNING and can never start the job; then the
server job and client jobs are stopped (whole process groups), every site is freed and the
result kept (by whoever works on the job at that moment: this handler, the dispatch or
the monitor). The reply is the record; a job already done is refused and left as it is.
"""

from __future__ import annotations

from fedhive.bus import Delivery
from fedhive.errors import FailedPrecondition, IllegalTransition
from fedhive.jobs.events import publish_status
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import record_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2

from .context import RunnerContext
from .finish import wind_up

MAX_RACES = 5  # the status moved under us (DISPATCHED -> RUNNING): read it again and retry


def handle_abort(ctx: RunnerContext, request: admin_pb2.AbortJobRequest, delivery: Delivery,
                 ) -> job_pb2.JobRecord:
    ctx.check_owner()
    record = _aborted(ctx, request, delivery)
    with ctx.try_job_lock(record.job_id) as free:
        # not free: a dispatch or the monitor works on the job; it sees the abort and cleans up
        entry = ctx.runs.get(record.job_id) if free else None
        if entry is not None:
            record = wind_up(ctx, entry, record.status_reason)
    return record_to_proto(record)


def _aborted(ctx: RunnerContext, request: admin_pb2.AbortJobRequest, delivery: Delivery,
             ) -> JobRecord:
    for _ in range(MAX_RACES):
        record = ctx.state.get_job(request.job_id)
        if record.status == JobStatus.FINISHED_ABORTED and delivery.redelivered:
            return record  # this abort's first delivery did it and lost its reply
        if record.status.is_final:
            raise FailedPrecondition(
                f"job {record.job_id} is already done ({record.status.value}): nothing changed",
                field="job_id")
        reason = request.reason.strip() or f"Aborted the job {record.job_id}."
        try:
            record = ctx.state.change_status(record.job_id, record.status,
                                             JobStatus.FINISHED_ABORTED, reason)
        except IllegalTransition:
            continue
        publish_status(ctx.bus, record)
        ctx.log.info("job_runner.aborted", job_id=record.job_id, reason=reason)
        return record
    raise FailedPrecondition(f"job {request.job_id} changed status too often to abort; retry",
                             field="job_id")
