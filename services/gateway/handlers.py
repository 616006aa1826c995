"""What the gateway does for an authenticated admin: authorise, then ask the job-store.

The gateway owns no job state. Every job command goes to the job-store over the bus
(`Names.service_queue("job-store")`, messages of jobstore.proto and admin.proto); uploads are
staged in S3 first and downloads are streamed from presigned URLs the job-store hands out.
Each method takes the caller and the decoded request and returns the reply message or raises
a `FedhiveError`; the servicer (servicer.py) translates errors to gRPC once.

Authorisation: `fedhive.auth.decide` on the action and, for job actions, the job's submitter
(read from the job-store first; an operation may reuse a running job's record read within the
last second, `GatewayConfig.operating_record_s`). Every decision is logged with user, action
and job.

A job id in a request may be a unique case-insensitive prefix of one (the job-store resolves
it, `fedhive_services.job_store.context.lookup_job`); what the gateway forwards after reading
the job names the full id.

Request fields are held to `fedhive.jobs.limits` before anything is staged or forwarded, and a
submit that ends in any error deletes its staged upload (the job-store deletes it too when it
refuses; this covers the job-store not answering).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from fedhive.auth import Action, Admin, decide, denial
from fedhive.blobs import BlobStore
from fedhive.bus import Bus
from fedhive.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RpcTimeout,
    Unavailable,
    Unroutable,
)
from fedhive.jobs.archive import MiB
from fedhive.jobs.limits import (
    MAX_FILTER,
    MAX_JOB_ID,
    MAX_REASON,
    check_chosen_job_id,
    check_list_limit,
    check_submission_id,
    check_text,
)
from fedhive.jobs.serde import status_from_proto, submitter_from_proto, submitter_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2, operation_pb2

from .download import stream_url

M = TypeVar("M", bound=Message)
JOB_STORE = "job-store"


@dataclass(frozen=True)
class GatewayConfig:
    max_archive_bytes: int = 256 * MiB  # an upload past this is refused while it arrives
    rpc_timeout: float = 30.0  # per job-store call
    submit_timeout: float = 120.0  # the job-store validates and stores the archive
    watch_interval: float = 0.5  # how often WatchJob re-reads the job
    chunk_size: int = 1 * MiB  # DownloadJob chunk size
    url_expiry_s: int = 600  # lifetime of the presigned URLs the gateway asks for
    max_operation_wait_s: float = 20.0  # longest a RunOperation reply waits for its result
    export_timeout: float = 600.0  # a server job copies an operation's result upwards
    # JobLogs --follow: how long after a job ended its stream waits for sites that never
    # sent their last line (the usual end is sooner: every site's last line is in)
    logs_grace_s: float = 10.0
    # A running job's record, read for an operation, serves its next operations this long: a
    # hub site runs one or two every round (tens a second with a small model), each then one
    # job-store call less. Short: an operation sent in this window after the job was aborted
    # reaches its stopping server job and waits out its timeout before being refused.
    operating_record_s: float = 1.0


class Gateway:
    def __init__(
        self, bus: Bus, blobs: BlobStore, names: Names, config: GatewayConfig, log: Any
    ) -> None:
        self._bus = bus
        self._blobs = blobs
        self._names = names
        self._config = config
        self._log = log
        self._queue = names.service_queue(JOB_STORE)
        self._closing = threading.Event()
        self._operating: dict[str, tuple[float, job_pb2.JobRecord]] = {}  # job id -> when read
        self._operating_lock = threading.Lock()

    def close(self) -> None:
        """End running WatchJob streams (with UNAVAILABLE: the client may watch again)."""
        self._closing.set()

    # -- authorisation ---------------------------------------------------------------------
    def _authorize(
        self, admin: Admin, action: Action, job: job_pb2.JobRecord | None = None
    ) -> None:
        submitter = submitter_from_proto(job.submitter) if job is not None else None
        decision = decide(admin, action, submitter)
        job_id = job.job_id if job is not None else None
        self._log.info(
            "authz.allowed" if decision.allowed else "authz.denied",
            user=admin.name, org=admin.org, role=admin.role.value, action=action.value,
            job_id=job_id, right=decision.right.value, reason=decision.reason,
        )
        if not decision.allowed:
            raise denial(admin, decision, job_id)

    def _job_for(self, admin: Admin, action: Action, job_id: str) -> job_pb2.JobRecord:
        """Read the job (NOT_FOUND names it) and authorise `action` on it. `job_id` may be a
        unique prefix of the job's id (the job-store resolves it): callers go on with the
        record's `job_id`, the full one."""
        job = self._call(admin_pb2.GetJobRequest(job_id=_job_id(job_id)), job_pb2.JobRecord)
        self._authorize(admin, action, job)
        return job

    def _call(self, request: Message, reply_type: type[M], timeout: float | None = None) -> M:
        return self._bus.call(self._queue, request, reply_type,
                              timeout=timeout or self._config.rpc_timeout)

    # -- AdminService ----------------------------------------------------------------------
    def submit(self, admin: Admin, chunks: Iterable[admin_pb2.SubmitJobChunk]
               ) -> admin_pb2.SubmitJobReply:
        self._authorize(admin, Action.SUBMIT)
        started = time.monotonic()
        options, parts = self._receive(chunks)
        received = time.monotonic()
        key = self._names.staging_key(uuid.uuid4().hex)
        self._blobs.put(key, parts)
        staged = time.monotonic()
        request = jobstore_pb2.StoreSubmitJob(
            staging_key=key, submitter=submitter_to_proto(admin.as_submitter()),
            submission_id=options.submission_id, queue_anyway=options.queue_anyway,
            job_id=options.job_id,
        )
        # The job-store deletes the staged archive once it has stored or refused it.
        try:
            reply = self._call(request, admin_pb2.SubmitJobReply, self._config.submit_timeout)
        except BaseException:
            self._drop_staged(key)
            raise
        self._log.info("job.submitted", user=admin.name, job_id=reply.job_id,
                       existed=reply.existed, bytes=sum(len(p) for p in parts),
                       receive_ms=_ms(received - started), stage_ms=_ms(staged - received),
                       store_ms=_ms(time.monotonic() - staged))
        return reply

    def _drop_staged(self, key: str) -> None:
        """Best effort: the caller must hear the submit's error, not a failing cleanup."""
        try:
            self._blobs.delete(key)
        except Exception as err:
            self._log.warning("job.staging_not_deleted", key=key, error=repr(err))

    def _receive(self, chunks: Iterable[admin_pb2.SubmitJobChunk]
                 ) -> tuple[admin_pb2.SubmitJobChunk, list[bytes]]:
        """The first chunk (it carries the options, checked first) and the archive's parts,
        size-checked as they arrive so an oversized upload is refused before it is all
        received."""
        limit = self._config.max_archive_bytes
        options: admin_pb2.SubmitJobChunk | None = None
        parts: list[bytes] = []
        total = 0
        for chunk in chunks:
            if options is None:
                options = _check_options(chunk)
            total += len(chunk.data)
            if total > limit:
                raise InvalidArgument(
                    f"job archive is larger than the limit of {_size(limit)}", field="archive"
                )
            if chunk.data:
                parts.append(chunk.data)
        if options is None or total == 0:
            raise InvalidArgument("the job archive is empty", field="archive")
        return options, parts

    def list_jobs(self, admin: Admin, request: admin_pb2.ListJobsRequest
                  ) -> admin_pb2.ListJobsReply:
        self._authorize(admin, Action.LIST)
        check_list_limit(request.limit)
        for field in ("name", "submitter", "id_prefix"):
            check_text(getattr(request, field), field, MAX_FILTER)
        return self._call(request, admin_pb2.ListJobsReply)

    def get_job(self, admin: Admin, job_id: str) -> job_pb2.JobRecord:
        self._authorize(admin, Action.GET)
        return self._call(admin_pb2.GetJobRequest(job_id=_job_id(job_id)), job_pb2.JobRecord)

    def job_metrics(self, admin: Admin, job_id: str) -> admin_pb2.JobMetrics:
        """The rounds the job's workflows reported so far (authorised as `get_job`)."""
        self._authorize(admin, Action.METRICS)
        return self._call(admin_pb2.GetJobMetricsRequest(job_id=_job_id(job_id)),
                          admin_pb2.JobMetrics)

    def clone_job(self, admin: Admin, job_id: str) -> admin_pb2.SubmitJobReply:
        job = self._job_for(admin, Action.CLONE, job_id)
        request = jobstore_pb2.StoreCloneJob(
            job_id=job.job_id, submitter=submitter_to_proto(admin.as_submitter())
        )
        reply = self._call(request, admin_pb2.SubmitJobReply)
        self._log.info("job.cloned", user=admin.name, job_id=reply.job_id,
                       cloned_from=job.job_id)
        return reply

    def resume_job(self, admin: Admin, job_id: str) -> admin_pb2.SubmitJobReply:
        job = self._job_for(admin, Action.RESUME, job_id)
        request = jobstore_pb2.StoreResumeJob(
            job_id=job.job_id, submitter=submitter_to_proto(admin.as_submitter())
        )
        reply = self._call(request, admin_pb2.SubmitJobReply)
        self._log.info("job.resumed", user=admin.name, job_id=reply.job_id,
                       resumed_from=job.job_id)
        return reply

    def delete_job(self, admin: Admin, job_id: str) -> admin_pb2.DeleteJobReply:
        job = self._job_for(admin, Action.DELETE, job_id)
        reply = self._call(admin_pb2.DeleteJobRequest(job_id=job.job_id),
                           admin_pb2.DeleteJobReply)
        self._log.info("job.deleted", user=admin.name, job_id=job.job_id)
        return reply

    def abort_job(self, admin: Admin, request: admin_pb2.AbortJobRequest) -> job_pb2.JobRecord:
        check_text(request.reason, "reason", MAX_REASON)
        job = self._job_for(admin, Action.ABORT, request.job_id)
        reason = request.reason or f"aborted by {admin.name}"
        record = self._call(admin_pb2.AbortJobRequest(job_id=job.job_id, reason=reason),
                            job_pb2.JobRecord)
        self._log.info("job.aborted", user=admin.name, job_id=job.job_id)
        return record

    def download_job(self, admin: Admin, request: admin_pb2.DownloadJobRequest
                     ) -> Iterator[bytes]:
        """The definition (or result) bytes in chunks; errors before the first chunk."""
        job = self._job_for(admin, Action.DOWNLOAD, request.job_id)
        urls = self._call(
            jobstore_pb2.StoreDownloadJob(job_id=job.job_id,
                                          expires_in_s=self._config.url_expiry_s),
            jobstore_pb2.StoreDownloadReply,
        )
        what = f"job {job.job_id} {'result' if request.result else 'definition'}"
        url = urls.result_url if request.result else urls.definition_url
        if not url:
            raise NotFound(f"{what}: the job has none", field="result")
        self._log.info("job.download", user=admin.name, job_id=job.job_id,
                       result=request.result)
        return stream_url(url, what, chunk_size=self._config.chunk_size,
                          timeout=self._config.rpc_timeout)

    def watch_job(self, admin: Admin, job_id: str, active: Callable[[], bool]
                  ) -> Iterator[job_pb2.JobRecord]:
        """The job's record now and at every status change, ending after a final status."""
        self._authorize(admin, Action.WATCH)
        request = admin_pb2.GetJobRequest(job_id=_job_id(job_id))
        seen: tuple[int, int] | None = None
        while active():
            record = self._call(request, job_pb2.JobRecord)
            # A job-id prefix is resolved once: a later job with the same prefix cannot make
            # the watch ambiguous, and no read after the first searches the id index.
            request = admin_pb2.GetJobRequest(job_id=record.job_id)
            state = (record.status, len(record.history))
            if state != seen:
                seen = state
                yield record
            status = status_from_proto(record.status)
            if status is not None and status.is_final:
                return
            if self._closing.wait(self._config.watch_interval):
                raise Unavailable("the gateway is shutting down; watch again", field="gateway")

    def job_logs(self, admin: Admin, request: admin_pb2.JobLogsRequest,
                 active: Callable[[], bool]) -> Iterator[admin_pb2.JobLogPage]:
        """Pages of the job's log lines from the job-store (authorised as `get_job`): the first
        page always (it names the job and the sites that do not share their logs), then every
        page with lines. Without `follow` it ends once the lines stored are read; with it, it
        polls for new ones until the job is final and its logs are complete (every site that
        ran it sent its last line), or `logs_grace_s` after the job ended."""
        self._authorize(admin, Action.LOGS)
        check_text(request.site, "site", MAX_FILTER)
        check_text(request.after, "after", MAX_FILTER)
        page_request = admin_pb2.JobLogsRequest(job_id=_job_id(request.job_id),
                                                site=request.site.strip(), after=request.after,
                                                limit=request.limit)
        first, final_since = True, None
        private: list[str] = []
        while active():
            page = self._call(page_request, admin_pb2.JobLogPage)
            page_request.job_id = page.job_id  # a prefix is resolved once (as WatchJob)
            if page.lines:
                page_request.after = page.lines[-1].id
            if first or page.lines or list(page.private_sites) != private:
                first, private = False, list(page.private_sites)
                yield page
            if page.more:
                continue
            if not request.follow or page.complete:
                return
            if page.final:
                final_since = final_since if final_since is not None else time.monotonic()
                if time.monotonic() - final_since >= self._config.logs_grace_s:
                    return
            if self._closing.wait(self._config.watch_interval):
                raise Unavailable("the gateway is shutting down; follow again", field="gateway")

    # -- operations (an operation-driven job's server job answers them) ---------------------
    def run_operation(self, admin: Admin, request: operation_pb2.OperationRequest
                      ) -> operation_pb2.OperationReply:
        """Forward the operation to the job's server job; Unavailable (try again) while the job
        is not running yet, FailedPrecondition once it has ended."""
        job = self._operated_job(admin, request.job_id)
        wait_s = max(0.0, min(request.wait_ms / 1000, self._config.max_operation_wait_s))
        forwarded = operation_pb2.OperationRequest()
        forwarded.CopyFrom(request)
        forwarded.job_id, forwarded.wait_ms = job.job_id, int(wait_s * 1000)
        reply = self._server_job(admin, job, forwarded, operation_pb2.OperationReply,
                                 wait_s + self._config.rpc_timeout)
        self._log.info("job.operation", user=admin.name, job_id=job.job_id,
                       op_id=request.op_id[:128], task=request.task_name[:128],
                       state=operation_pb2.OperationReply.State.Name(reply.state))
        return reply

    def export_operation(self, admin: Admin, request: operation_pb2.ExportRequest
                         ) -> operation_pb2.ExportReply:
        job = self._operated_job(admin, request.job_id)
        forwarded = operation_pb2.ExportRequest()
        forwarded.CopyFrom(request)
        forwarded.job_id = job.job_id
        return self._server_job(admin, job, forwarded, operation_pb2.ExportReply,
                                self._config.export_timeout)

    def _operated_job(self, admin: Admin, job_id: str) -> job_pb2.JobRecord:
        """`_running_job`, its record reused for `operating_record_s` when named by its full
        id. The caller is authorised on every call (the submitter a decision reads never
        changes); the status may have moved on, but a job that ended has no server job to
        answer, and `_server_job` then reads the record afresh for the error."""
        now = time.monotonic()
        with self._operating_lock:
            read = self._operating.get(job_id)
        if read is not None and now - read[0] < self._config.operating_record_s:
            self._authorize(admin, Action.OPERATE, read[1])
            return read[1]
        job = self._running_job(admin, job_id)
        if job.job_id == job_id:
            with self._operating_lock:
                for stale in [key for key, (when, _) in self._operating.items()
                              if now - when >= self._config.operating_record_s]:
                    del self._operating[stale]
                self._operating[job_id] = (now, job)
        return job

    def _running_job(self, admin: Admin, job_id: str) -> job_pb2.JobRecord:
        job = self._job_for(admin, Action.OPERATE, job_id)
        status = status_from_proto(job.status)
        if status is not None and status.is_final:
            why = job.history[-1].reason if job.history else ""
            raise FailedPrecondition(f"job {job.job_id} is {status.value} ({why[:500]}): it "
                                     "takes no more operations", field="job_id")
        if status is not JobStatus.RUNNING:
            raise Unavailable(f"job {job.job_id} is {status.value if status else 'unknown'}: "
                              "its operations start once it runs", field="job_id")
        return job

    def _server_job(self, admin: Admin, job: job_pb2.JobRecord, request: Message,
                    reply_type: type[M], timeout: float) -> M:
        try:
            return self._bus.call(self._names.job_server_queue(job.job_id), request,
                                  reply_type, timeout=timeout)
        except Unroutable:  # running, but its server job is not serving yet (or just ended)
            self._ended_since(admin, job)
            raise Unavailable(f"job {job.job_id}: its server job is not serving (starting or "
                              "ending); try again", field="job_id") from None
        except RpcTimeout:  # e.g. sent as the server job stopped consuming: lost with its queue
            self._ended_since(admin, job)
            raise

    def _ended_since(self, admin: Admin, job: job_pb2.JobRecord) -> None:
        """FailedPrecondition with the job's end when it ended since its record was read."""
        with self._operating_lock:
            self._operating.pop(job.job_id, None)
        self._running_job(admin, job.job_id)

    def list_sites(self, admin: Admin) -> admin_pb2.ListSitesReply:
        self._authorize(admin, Action.SITES)
        return self._call(admin_pb2.ListSitesRequest(), admin_pb2.ListSitesReply)


def _check_options(first: admin_pb2.SubmitJobChunk) -> admin_pb2.SubmitJobChunk:
    """The submit options (on the first chunk), checked before the rest is read."""
    check_submission_id(first.submission_id)
    check_chosen_job_id(first.job_id)
    return first


def _job_id(job_id: str) -> str:
    if not job_id.strip():
        raise InvalidArgument("job_id is required", field="job_id")
    return check_text(job_id.strip(), "job_id", MAX_JOB_ID)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n} bytes"
