"""Submit, clone and resume: the ways a job comes into being.

All are idempotent under redelivery: the new job's id is derived from the bus message id
(`job_id_for`), and each step is safe to repeat (putting the same bytes at the same key,
creating a record that may already exist, publishing an event with a fixed message id). A
crash between any two steps is finished by the redelivery. A refusal (any `FedhiveError`, or an
input the code cannot handle) stores nothing and deletes the staged upload.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import structlog

from fedhive.bus import Delivery
from fedhive.errors import (
    AlreadyExists,
    BlobNotFound,
    FailedPrecondition,
    FedhiveError,
    InvalidArgument,
    NotFound,
)
from fedhive.jobs.archive import UnsafeArchive
from fedhive.jobs.definition import load_job
from fedhive.jobs.limits import check_chosen_job_id, check_submission_id
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.serde import submitter_from_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.scheduling.feasibility import never_runnable
from fedhive.text import clip

from .context import (
    DATA_ERRORS,
    JobStoreContext,
    find_job,
    job_id_for,
    lookup_job,
    publish_status,
)

log = structlog.get_logger()

SUBMISSION_SCOPE = "job-store.submission"
SUBMISSION_TTL_S = 30 * 24 * 3600.0  # how long a submission id keeps answering its job
# What ends a request for good (answered with an error, never redelivered)
REFUSED: tuple[type[Exception], ...] = (FedhiveError, *DATA_ERRORS)


def submit_job(
    cmd: jobstore_pb2.StoreSubmitJob, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.SubmitJobReply:
    staging = _staging_key(cmd.staging_key, ctx)  # a key outside staging is never deleted
    chosen = check_chosen_job_id(cmd.job_id)
    job_id = chosen or job_id_for(ctx.names.ns, delivery.message_id)
    bound = log.bind(service="job-store", job_id=job_id, submitter=cmd.submitter.name)
    try:
        submitter = _submitter(cmd.submitter)
        done = find_job(ctx, job_id)
        if done is not None and chosen and done.submitter.name != submitter.name:
            raise AlreadyExists(f"job id {job_id} is taken by a job of another submitter",
                                field="job_id")
        if done is not None:  # a redelivery after the record was stored, or a chosen id again
            _finish(ctx, done, staging)
            bound.info("job.submit_finished_on_redelivery" if not chosen else
                       "job.submit_repeated", existing=job_id)
            return admin_pb2.SubmitJobReply(job_id=job_id, existed=bool(chosen))
        submission_id = check_submission_id(cmd.submission_id)
        definition = load_job(_read_staged(ctx, staging), ctx.limits)
        if not cmd.queue_anyway:
            _refuse_never_runnable(ctx, definition.meta)
        archive = definition.to_zip()
        assert archive is not None  # to_zip() without a target returns the bytes
        # The definition goes first: a repeated submit can then tell a first submit still in
        # progress (its definition is there) from a deleted job (gone).
        key = _put_definition(ctx, job_id, archive)
        earlier = _earlier_job(ctx, submitter, submission_id, archive, job_id) \
            if submission_id else None
        if earlier is None:
            record = _create(ctx, job_id, definition.meta, submitter, key)
        else:
            ctx.blobs.delete(key)
            record = find_job(ctx, earlier) or _create(
                ctx, earlier, definition.meta, submitter, ctx.names.job_definition_key(earlier)
            )
    except REFUSED:
        _discard(ctx, staging, job_id)
        raise
    _finish(ctx, record, staging)
    if earlier is not None:
        bound.info("job.submit_repeated", existing=earlier)
        return admin_pb2.SubmitJobReply(job_id=earlier, existed=True)
    bound.info("job.submitted", name=record.meta.name)
    return admin_pb2.SubmitJobReply(job_id=job_id)


def _discard(ctx: JobStoreContext, staging: str, job_id: str) -> None:
    """After a refusal: the staged upload and, unless `job_id` has a record, its definition.
    Best effort: the refusal is what the caller must hear, not a failing cleanup."""
    try:
        ctx.blobs.delete(staging)
        if find_job(ctx, job_id) is None:
            ctx.blobs.delete(ctx.names.job_definition_key(job_id))
    except Exception as err:  # the refusal is still answered; the leftover is logged
        log.warning("job_store.cleanup_failed", service="job-store", job_id=job_id,
                    staging=staging, error=repr(err))


def clone_job(
    cmd: jobstore_pb2.StoreCloneJob, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.SubmitJobReply:
    submitter = _submitter(cmd.submitter)
    source = lookup_job(ctx, cmd.job_id)
    job_id = job_id_for(ctx.names.ns, delivery.message_id)
    record = find_job(ctx, job_id)
    if record is None:
        meta = replace(source.meta, extra={**source.meta.extra, "cloned_from": source.job_id})
        record = _store(ctx, job_id, meta, submitter, _definition(ctx, source, "clone"))
    if len(record.history) == 1:  # still as created: (re)announce it
        publish_status(ctx, record)
    log.info("job.cloned", service="job-store", job_id=job_id, cloned_from=source.job_id)
    return admin_pb2.SubmitJobReply(job_id=job_id)


RESUMABLE = (
    JobStatus.FINISHED_ABORTED,
    JobStatus.FINISHED_EXECUTION_EXCEPTION,
    JobStatus.FINISHED_ABNORMAL,
)


def resume_job(
    cmd: jobstore_pb2.StoreResumeJob, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.SubmitJobReply:
    """A clone that continues: the new record names the source in `resumed_from`, and its
    server job starts from the source's checkpoint (`Names.job_checkpoint_key`), which the
    workflows write after every completed round."""
    submitter = _submitter(cmd.submitter)
    source = lookup_job(ctx, cmd.job_id)
    job_id = job_id_for(ctx.names.ns, delivery.message_id)
    record = find_job(ctx, job_id)
    if record is None:
        if source.status not in RESUMABLE:
            raise FailedPrecondition(
                f"job {source.job_id} is {source.status.value}; only ABORTED, "
                "EXECUTION_EXCEPTION or ABNORMAL jobs can be resumed",
                field="job_id",
            )
        if not ctx.blobs.exists(ctx.names.job_checkpoint_key(source.job_id)):
            raise FailedPrecondition(
                f"job {source.job_id} completed no round: nothing to resume from",
                field="job_id",
            )
        # The definition's lineage is `resumed_from`; a `cloned_from` the source carried
        # would name a job the new one was not cloned from.
        extra = {k: v for k, v in source.meta.extra.items() if k != "cloned_from"}
        record = _store(
            ctx, job_id, replace(source.meta, extra=extra), submitter,
            _definition(ctx, source, "resume"), resumed_from=source.job_id,
        )
    if len(record.history) == 1:
        publish_status(ctx, record)
    log.info("job.resumed", service="job-store", job_id=job_id, resumed_from=source.job_id)
    return admin_pb2.SubmitJobReply(job_id=job_id)


def _definition(ctx: JobStoreContext, source: JobRecord, what: str) -> bytes:
    try:
        return ctx.blobs.get(source.archive_key)
    except BlobNotFound:
        raise NotFound(
            f"job {source.job_id} has no stored definition to {what}", field="job_id"
        ) from None


def _refuse_never_runnable(ctx: JobStoreContext, meta: JobMeta) -> None:
    """InvalidArgument when no registered site could ever run the job (see
    `fedhive.scheduling.feasibility`); `queue_anyway` skips this."""
    problems = never_runnable(meta, ctx.state.last_heartbeats())
    if problems:
        raise InvalidArgument(
            f"job {meta.name!r} can never run: {'; '.join(problems)} "
            "(submit with --queue-anyway to queue it anyway)",
            field="resource_spec" if "in total" in problems[0] else "mandatory_clients",
        )


def _staging_key(key: str, ctx: JobStoreContext) -> str:
    prefix = ctx.names.staging_key("")[: -len(".zip")]
    if not key.startswith(prefix) or ".." in key or len(key) <= len(prefix):
        raise InvalidArgument(
            f"staging key {clip(key)} is not under {prefix!r}", field="staging_key"
        )
    return key


def _submitter(message: job_pb2.Submitter) -> Submitter:
    if not message.name.strip():
        raise InvalidArgument("submitter name is empty", field="submitter.name")
    return submitter_from_proto(message)


def _read_staged(ctx: JobStoreContext, staging: str) -> bytes:
    """The staged archive, refused before download when it is over the archive size limit."""
    try:
        size = ctx.blobs.size(staging)
        if size > ctx.limits.max_archive_bytes:
            raise UnsafeArchive(
                [f"archive is {size} bytes, more than the limit of "
                 f"{ctx.limits.max_archive_bytes}"],
                field="archive",
            )
        return ctx.blobs.get(staging)
    except BlobNotFound:
        raise NotFound(f"staged archive {staging} not found", field="staging_key") from None


def _earlier_job(
    ctx: JobStoreContext, submitter: Submitter, submission_id: str, archive: bytes, job_id: str
) -> str | None:
    """The job an earlier request with this submission id made (None: this request's own).

    The first request to remember `<digest> <job_id>` for the id wins; the normalised archive's
    SHA-256 decides whether a later request carries the same content. An earlier job whose
    definition is stored but whose record is not (its request is still in progress, or died
    after storing the definition) is returned too: the caller finishes it, as the first
    request would (both create the same record; the second finds it there).
    """
    digest = hashlib.sha256(archive).hexdigest()
    kept = ctx.state.remember(
        SUBMISSION_SCOPE, f"{submitter.name}:{submission_id}", f"{digest} {job_id}",
        SUBMISSION_TTL_S,
    )
    kept_digest, kept_job = kept.split(" ", 1)
    if kept_job == job_id:
        return None
    if kept_digest != digest:
        raise AlreadyExists(
            f"submission id {submission_id!r} was already used for different job content "
            f"(job {kept_job}); use a new submission id for a new job",
            field="submission_id",
        )
    if find_job(ctx, kept_job) is None and not ctx.blobs.exists(
        ctx.names.job_definition_key(kept_job)
    ):
        raise NotFound(
            f"submission id {submission_id!r} belongs to job {kept_job}, which was deleted; "
            "use a new submission id",
            field="submission_id",
        )
    return kept_job


def _put_definition(ctx: JobStoreContext, job_id: str, archive: bytes) -> str:
    key = ctx.names.job_definition_key(job_id)
    ctx.blobs.put(key, archive)
    return key


def _store(
    ctx: JobStoreContext, job_id: str, meta: JobMeta, submitter: Submitter, archive: bytes,
    *, resumed_from: str = "",
) -> JobRecord:
    """Put the definition, then create the record."""
    key = _put_definition(ctx, job_id, archive)
    return _create(ctx, job_id, meta, submitter, key, resumed_from=resumed_from)


def _create(
    ctx: JobStoreContext, job_id: str, meta: JobMeta, submitter: Submitter, key: str,
    *, resumed_from: str = "",
) -> JobRecord:
    """The SUBMITTED record of a stored definition; a record already there (a concurrent
    redelivery or repeated submit got here first) is taken as it is."""
    reason = f"resumed from job {resumed_from}" if resumed_from else "submitted"
    try:
        return ctx.state.create_job(job_id, meta, submitter, archive_key=key, reason=reason,
                                    resumed_from=resumed_from)
    except AlreadyExists:
        return ctx.state.get_job(job_id)


def _finish(ctx: JobStoreContext, record: JobRecord, staging: str) -> None:
    """Announce the submission (unless the job moved on already) and drop the staged upload."""
    if len(record.history) == 1:
        publish_status(ctx, record)
    ctx.blobs.delete(staging)
