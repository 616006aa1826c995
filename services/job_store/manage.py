"""Requests that act on one existing job: delete, download, abort."""

from __future__ import annotations

import structlog

from fedhive.bus import Delivery
from fedhive.errors import (
    FailedPrecondition,
    IllegalTransition,
    InvalidArgument,
    NotFound,
    RpcTimeout,
    Unavailable,
    Unroutable,
)
from fedhive.jobs.limits import MAX_REASON, check_text
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2

from .context import JobStoreContext, lookup_job, publish_status
from .replies import record_reply

log = structlog.get_logger()

DEFAULT_URL_LIFETIME_S = 3600
MAX_URL_LIFETIME_S = 7 * 24 * 3600  # the longest an S3 presigned URL may live
RUNNER = "job-runner"
RUNNER_TIMEOUT_S = 30.0  # the runner answers once the job is ABORTED (cleanup follows)


def delete_job(
    request: admin_pb2.DeleteJobRequest, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.DeleteJobReply:
    """Only a job in a final status: its S3 objects first, then the record, so a crash in
    between leaves a record whose redelivered delete finishes the work."""
    try:
        record = lookup_job(ctx, request.job_id)
    except NotFound:
        if delivery.redelivered:  # the first delivery deleted it and then lost its reply
            return admin_pb2.DeleteJobReply()
        raise
    if not record.status.is_final:
        what = "is running" if record.status != JobStatus.SUBMITTED else "is waiting to run"
        raise FailedPrecondition(
            f"job: {record.job_id} {what} ({record.status.value}), could not be deleted at "
            "this time.",
            field="job_id",
        )
    removed = ctx.blobs.delete_prefix(ctx.names.job_prefix(record.job_id))
    ctx.state.delete_job(record.job_id)
    log.info("job.deleted", service="job-store", job_id=record.job_id, objects=removed)
    return admin_pb2.DeleteJobReply()


def download_job(
    request: jobstore_pb2.StoreDownloadJob, delivery: Delivery, ctx: JobStoreContext
) -> jobstore_pb2.StoreDownloadReply:
    """Presigned GETs of the definition and (when there is one) the result of a finished job."""
    lifetime = request.expires_in_s or DEFAULT_URL_LIFETIME_S
    if not 0 < lifetime <= MAX_URL_LIFETIME_S:
        raise InvalidArgument(
            f"expires_in_s {request.expires_in_s} must be between 1 and {MAX_URL_LIFETIME_S}",
            field="expires_in_s",
        )
    record = lookup_job(ctx, request.job_id)
    if not record.status.is_final:
        raise FailedPrecondition(
            f"job {record.job_id} is not done ({record.status.value})", field="job_id"
        )
    definition = ctx.blobs.presign_get(
        record.archive_key or ctx.names.job_definition_key(record.job_id), lifetime
    )
    result_url = ""
    if record.result_key and ctx.blobs.exists(record.result_key):
        result_url = ctx.blobs.presign_get(record.result_key, lifetime).url
    return jobstore_pb2.StoreDownloadReply(
        definition_url=definition.url, result_url=result_url,
        expires_at_ms=definition.expires_at_ms,
    )


def abort_job(
    request: admin_pb2.AbortJobRequest, delivery: Delivery, ctx: JobStoreContext
) -> job_pb2.JobRecord:
    """SUBMITTED -> FINISHED:ABORTED through the status compare-and-set, with its event; a
    DISPATCHED or RUNNING job is the job-runner's: the request is forwarded to it (it stops the
    server and client jobs and frees the sites) and its answer returned.

    A job the scheduler dispatches meanwhile loses the race cleanly (the CAS fails) and is
    forwarded as a dispatched job. A redelivered abort of a job it already aborted re-publishes
    the event and answers the record.
    """
    check_text(request.reason, "reason", MAX_REASON)
    record = lookup_job(ctx, request.job_id)
    if record.status == JobStatus.SUBMITTED:
        reason = request.reason.strip() or f"Aborted the job {record.job_id} before running it."
        try:
            record = ctx.state.change_status(
                record.job_id, JobStatus.SUBMITTED, JobStatus.FINISHED_ABORTED, reason
            )
        except IllegalTransition:
            record = ctx.state.get_job(record.job_id)
        else:
            publish_status(ctx, record)
            log.info("job.aborted", service="job-store", job_id=record.job_id, reason=reason)
            return record_reply(record)
    if record.status == JobStatus.FINISHED_ABORTED and delivery.redelivered:
        publish_status(ctx, record)
        return record_reply(record)
    if record.status.is_final:
        raise FailedPrecondition(
            f"job {record.job_id} is already done ({record.status.value}): nothing changed",
            field="job_id",
        )
    return _forward_to_runner(request, record, ctx)


def _forward_to_runner(
    request: admin_pb2.AbortJobRequest, record: JobRecord, ctx: JobStoreContext
) -> job_pb2.JobRecord:
    """The job-runner's answer to the abort (its typed errors travel back unchanged)."""
    forwarded = admin_pb2.AbortJobRequest()
    forwarded.CopyFrom(request)
    forwarded.job_id = record.job_id  # the full id, when the request gave a prefix
    try:
        return ctx.runner.call(ctx.names.service_queue(RUNNER), forwarded, job_pb2.JobRecord,
                               timeout=RUNNER_TIMEOUT_S)
    except (RpcTimeout, Unroutable):
        raise Unavailable(
            f"job {record.job_id} is {record.status.value} and the job-runner did not answer "
            "the abort; try again", field="job_id",
        ) from None
