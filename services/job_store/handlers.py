"""The job-store's RPC contract and its dispatcher.

The job-store serves `Names.service_queue("job-store")` (`{ns}.job-store`). The gateway has
already authenticated and authorised the caller; every request is an RPC (`Bus.call`) whose
reply type is fixed by the request type. Errors travel back as typed `fedhive.errors`:

request (`fedhive.v1.*`) -> reply; errors (code: when):

* Any request: INVALID_ARGUMENT: a `job_id` longer than `limits.MAX_JOB_ID`. INTERNAL: an
  input the code cannot handle (`context.DATA_ERRORS`: a value out of range for its wire type,
  ...), answered at once with "the job-store could not handle <request>: <error type>" and
  logged with its traceback; never redelivered.
* Any request naming an existing job (get, metrics, clone, resume, delete, download, abort):
  its `job_id` is the job's id, or a prefix of exactly one job's id, ignoring case
  (`context.lookup_job`; the reply and everything done after name the full id).
  INVALID_ARGUMENT: "job id prefix <p> is ambiguous: it matches <up to 5 ids>[, ...]; give
  more of the id"; NOT_FOUND: "job <p> not found" when no id starts with it.

* `StoreSubmitJob` -> `SubmitJobReply`.
  INVALID_ARGUMENT: every violation of the job or of the archive's safety, in one message
  joined by "; " (at most `archive.MAX_VIOLATIONS` lines); a staging key outside
  `{ns}/staging/`, an empty submitter name, a malformed submission id. ALREADY_EXISTS: the
  submission id was used before for different content. NOT_FOUND: no staged archive; the
  submission id's job was deleted. On every error nothing is stored and the staged archive
  (a key under `{ns}/staging/`) is deleted.
* `StoreCloneJob` -> `SubmitJobReply`. NOT_FOUND: no such job (or no stored definition).
* `StoreResumeJob` -> `SubmitJobReply`. NOT_FOUND: as clone. FAILED_PRECONDITION: the job is
  not FINISHED:ABORTED, FINISHED:EXECUTION_EXCEPTION or FINISHED:ABNORMAL ("job <id> is
  <status>; only ABORTED, EXECUTION_EXCEPTION or ABNORMAL jobs can be resumed"); it left no
  checkpoint ("job <id> completed no round: nothing to resume from").
* `ListJobsRequest` -> `ListJobsReply`. INVALID_ARGUMENT: `limit` negative or above
  `limits.MAX_LIST_LIMIT`; a filter longer than `limits.MAX_FILTER`; JOB_STATUS_UNSPECIFIED
  among `statuses`.
* `GetJobRequest` -> `JobRecord`. NOT_FOUND: "job <id> not found".
* `JobLogsRequest` -> `JobLogPage`: a page of the job's shared log lines (`logs.py`).
  NOT_FOUND as above; INVALID_ARGUMENT: a bad `site`, `after` or `limit`.
* `GetJobMetricsRequest` -> `JobMetrics`: the rounds the job's server job logged so far
  (`fedhive.state.rounds`), oldest first; none yet is an empty list. NOT_FOUND as above.
* `DeleteJobRequest` -> `DeleteJobReply`. NOT_FOUND; FAILED_PRECONDITION: the job is not in a
  final status ("job: <id> is running (RUNNING), could not be deleted at this time.").
* `StoreDownloadJob` -> `StoreDownloadReply`. NOT_FOUND; FAILED_PRECONDITION: "job <id> is
  not done (<status>)" for any status but FINISHED:* (as FLARE's download_job);
  INVALID_ARGUMENT: `expires_in_s` outside 1..7 days.
* `AbortJobRequest` -> `JobRecord` (as it is after the abort). INVALID_ARGUMENT: a reason
  longer than `limits.MAX_REASON`. NOT_FOUND;
  FAILED_PRECONDITION: the job is already final ("job <id> is already done (<status>)"), or
  DISPATCHED/RUNNING (aborting those is the job-runner's).
* `ListSitesRequest` -> `ListSitesReply` (no errors).

Semantics:
* Submit: the gateway stages the upload at `Names.staging_key(upload_id)`; the job-store
  validates it (`fedhive.jobs.load_job`), stores the normalised archive at
  `Names.job_definition_key(job_id)`, creates the SUBMITTED record, publishes
  `job.status.SUBMITTED` and deletes the staged archive. Job ids are uuid4-form strings derived
  from the bus message id, so a redelivered request finishes the same job instead of making a
  second one. A submission id is scoped to the submitter's name: the same id with the same
  content answers the first job with `existed=true`; so does the same id while the first
  submit is still storing that job (the repeat creates the same record, whichever is first).
* Clone: a new job with the source's definition (copied), the caller as submitter and
  `cloned_from` in the meta's extra keys; SUBMITTED with its event.
* Resume: as clone, but the new record's `resumed_from` names the source (its history starts
  "resumed from job <id>"); the job-runner starts its server job with `--resume-from <id>`,
  which continues from the source's checkpoint (`Names.job_checkpoint_key`).
* List: newest first; filters combine with AND: `statuses` (any of), `name` (case-insensitive
  substring), `submitter` (exact name), `id_prefix` (case-insensitive); `limit` 0 means
  `limits.DEFAULT_LIST_LIMIT`. A reply stays under gRPC's 4 MiB message limit whatever is
  stored (`replies.py`): it ends early rather than grow past it, and a record stored before
  meta.json was bounded, too large or impossible to encode, comes trimmed (its meta replaced
  by its name and a note), as it does from `GetJobRequest`.
* Every status change publishes `job.status.<status value>` (e.g. `job.status.SUBMITTED`,
  `job.status.FINISHED:ABORTED`) with a `JobStatusEvent`; its message id is
  `<job_id>:<history length>`, so a re-published event can be recognised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from google.protobuf.message import Message

from fedhive.bus import Delivery, Handler
from fedhive.errors import FedhiveError, MalformedMessage
from fedhive.jobs.limits import MAX_JOB_ID, check_text
from fedhive.proto.v1 import admin_pb2, jobstore_pb2

from .context import DATA_ERRORS, JobStoreContext
from .logs import job_logs
from .manage import abort_job, delete_job, download_job
from .queries import get_job, get_job_metrics, list_jobs, list_sites
from .submit import clone_job, resume_job, submit_job

log = structlog.get_logger()

SERVICE = "job-store"

_HANDLERS: dict[type[Message], Callable[[Any, Delivery, JobStoreContext], Message]] = {
    jobstore_pb2.StoreSubmitJob: submit_job,
    jobstore_pb2.StoreCloneJob: clone_job,
    jobstore_pb2.StoreResumeJob: resume_job,
    admin_pb2.ListJobsRequest: list_jobs,
    admin_pb2.GetJobRequest: get_job,
    admin_pb2.GetJobMetricsRequest: get_job_metrics,
    admin_pb2.JobLogsRequest: job_logs,
    admin_pb2.DeleteJobRequest: delete_job,
    jobstore_pb2.StoreDownloadJob: download_job,
    admin_pb2.AbortJobRequest: abort_job,
    admin_pb2.ListSitesRequest: list_sites,
}

ACCEPTS: tuple[type[Message], ...] = tuple(_HANDLERS)


def make_handler(ctx: JobStoreContext) -> Handler:
    """The bus handler of the job-store queue: dispatch by request type to the functions above."""

    def handle(message: Message, delivery: Delivery) -> Message:
        handler = _HANDLERS.get(type(message))
        kind = type(message).__name__
        if handler is None:  # the consumer only decodes ACCEPTS; this is a wiring error
            raise MalformedMessage(f"the job-store does not handle {kind}", field="type")
        job_id = getattr(message, "job_id", None)
        if isinstance(job_id, str):
            check_text(job_id, "job_id", MAX_JOB_ID)
        try:
            return handler(message, delivery, ctx)
        except DATA_ERRORS as err:
            log.error("job_store.request_failed", service="job-store", request=kind,
                      message_id=delivery.message_id, exc_info=err)
            raise FedhiveError(
                f"the job-store could not handle {kind}: {type(err).__name__} (see its log)"
            ) from None

    return handle
