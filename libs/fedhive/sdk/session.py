"""`fedhive.sdk.Session`: the admin Python API over the gateway's gRPC AdminService.

    from fedhive.sdk import Session

    with Session("gateway.example:50051", token, root_certificates=Path("ca.pem")) as s:
        job_id = s.submit(Path("jobs/hello-numpy")).job_id
        for record in s.watch(job_id):
            print(record.status, record.status_reason)

Every method returns dataclasses (`fedhive.jobs.record.JobRecord`, `SubmitResult`, `SiteInfo`,
`fedhive.jobs.metrics.RoundMetrics`, `fedhive.joblogs.wire.LogEntry` through `logs`)
and raises `fedhive.errors` types: the gateway's error comes back as the same typed error
(`NotFound`, `PermissionDenied`, `Unauthenticated`, `InvalidArgument`, ...), translated once,
here. A job folder or zip is validated locally before it is uploaded.

A submit always carries a submission id (a uuid4 when the caller gives none) and is retried
with it when the gateway is unavailable, times out or drops the connection: a gateway that
dies after the job-store created the job cannot make the retry run the job twice, the retry
answers the job the first attempt created (`existed=True`).
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import grpc

from fedhive.errors import RpcTimeout, Unavailable, Unroutable
from fedhive.jobs.limits import check_chosen_job_id, check_list_limit, check_submission_id
from fedhive.jobs.metrics import RoundMetrics, round_from_proto
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import record_from_proto, status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, admin_pb2_grpc, operation_pb2
from fedhive.retry import Backoff
from fedhive.sdk.logs import LogStream
from fedhive.sdk.status import from_grpc
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.sites.serde import site_heartbeat_from_proto

if TYPE_CHECKING:  # the operation methods import them when called: numpy and the FL runtime
    from fedhive.fl.dxo import Dxo  # are not loaded for the CLI's every command
    from fedhive.sdk.operations import OperationResult

T = TypeVar("T")
CHUNK = 1024 * 1024
# How long a submit keeps retrying after its first failed attempt: long enough for a gateway
# to restart, short enough that a wrong address fails within a minute.
SUBMIT_RETRY = Backoff(base=0.5, cap=5.0, max_attempts=None, deadline=30.0)
# Errors after which the job may or may not exist: the retry (same id) finds out.
RETRIED = (Unavailable, RpcTimeout, Unroutable)


@dataclass(frozen=True)
class SubmitResult:
    job_id: str
    existed: bool = False  # the submission id was seen before with the same content
    submission_id: str = ""  # the id the submit carried (given, or generated)


@dataclass(frozen=True)
class SiteInfo:
    name: str
    online: bool
    last_heartbeat: SiteHeartbeat  # its sent_at_ms is when the site was last seen


def _read(value: bytes | Path | None) -> bytes | None:
    return value.read_bytes() if isinstance(value, Path) else value


class Session:
    """A connection to one gateway as one admin. Thread-safe; close it (or use `with`)."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls: bool = False,
        root_certificates: bytes | Path | None = None,
        client_cert: bytes | Path | None = None,
        client_key: bytes | Path | None = None,
        timeout: float = 60.0,
        submit_timeout: float = 600.0,
        submit_retry: Backoff = SUBMIT_RETRY,
    ) -> None:
        """`tls` (implied by any certificate argument): connect with TLS, trusting
        `root_certificates` (PEM; default: the system's CAs). `client_cert`/`client_key`:
        mutual TLS. `timeout`: seconds per call (uploads, downloads and watches excepted).
        `submit_timeout`: seconds per submit attempt (upload, validation and storing);
        `submit_retry`: how a submit is retried after `RETRIED` errors."""
        self.address = address
        self.timeout = timeout
        self.submit_timeout = submit_timeout
        self.submit_retry = submit_retry
        self._metadata = (("authorization", f"Bearer {token}"),)
        if tls or root_certificates or client_cert:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates),
                private_key=_read(client_key),
                certificate_chain=_read(client_cert),
            )
            self._channel = grpc.secure_channel(address, credentials)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as err:
            raise from_grpc(err, target=self.address) from None

    def _stream(self, responses: Iterable[T]) -> Iterator[T]:
        try:
            yield from responses
        except grpc.RpcError as err:
            raise from_grpc(err, target=self.address) from None

    # -- jobs ------------------------------------------------------------------------------
    def submit(self, job: Path | bytes, *, submission_id: str = "",
               queue_anyway: bool = False, job_id: str = "") -> SubmitResult:
        """Validate a job folder, zip file or zip bytes locally, then upload it.

        A folder is zipped (normalised); a zip goes up as it is, once it passed validation
        (the job-store normalises it again: re-compressing here would only add latency).
        `submission_id`: a client-chosen id; submitting the same content again with it returns
        the same job (`existed=True`) instead of a second one. Without one, a uuid4 is used;
        either way the result names it, and the retries (see the module doc) carry it.
        `job_id`: the new job's id, chosen by the caller (a uuid; a hub site gives its upper
        tier's): submitting again with it answers that job (`existed=True`).
        """
        from fedhive.jobs.definition import load_job  # the job formats: only submitting needs them

        submission_id = check_submission_id(submission_id) or str(uuid.uuid4())
        check_chosen_job_id(job_id)
        if isinstance(job, Path) and not job.is_file():  # a folder; or load_job says what is
            archive = load_job(job).to_zip()
            assert archive is not None
        else:
            archive = job.read_bytes() if isinstance(job, Path) else job
            load_job(archive)

        def chunks() -> Iterator[admin_pb2.SubmitJobChunk]:
            yield admin_pb2.SubmitJobChunk(data=archive[:CHUNK], submission_id=submission_id,
                                           queue_anyway=queue_anyway, job_id=job_id)
            for start in range(CHUNK, len(archive), CHUNK):
                yield admin_pb2.SubmitJobChunk(data=archive[start:start + CHUNK])

        def attempt() -> admin_pb2.SubmitJobReply:
            reply: admin_pb2.SubmitJobReply = self._call(lambda: self._stub.SubmitJob(
                chunks(), metadata=self._metadata, timeout=self.submit_timeout
            ))
            return reply

        reply = self.submit_retry.call(attempt, RETRIED)
        return SubmitResult(reply.job_id, reply.existed, submission_id)

    def list(self, *, status: JobStatus | Iterable[JobStatus] | None = None, name: str = "",
             submitter: str = "", id_prefix: str = "", limit: int = 0) -> list[JobRecord]:
        """Jobs newest first; filters combine with AND; `limit` 0: the gateway's page size."""
        statuses = [status] if isinstance(status, JobStatus) else list(status or [])
        check_list_limit(limit)
        request = admin_pb2.ListJobsRequest(
            statuses=[status_to_proto(s) for s in statuses], name=name, submitter=submitter,
            id_prefix=id_prefix, limit=limit,
        )
        reply = self._call(
            lambda: self._stub.ListJobs(request, metadata=self._metadata, timeout=self.timeout)
        )
        return [record_from_proto(job) for job in reply.jobs]

    def get(self, job_id: str) -> JobRecord:
        request = admin_pb2.GetJobRequest(job_id=job_id)
        return record_from_proto(self._call(
            lambda: self._stub.GetJob(request, metadata=self._metadata, timeout=self.timeout)
        ))

    def clone(self, job_id: str) -> SubmitResult:
        """A new job with the same definition, submitted by the caller."""
        request = admin_pb2.CloneJobRequest(job_id=job_id)
        reply = self._call(
            lambda: self._stub.CloneJob(request, metadata=self._metadata, timeout=self.timeout)
        )
        return SubmitResult(reply.job_id)

    def resume(self, job_id: str) -> SubmitResult:
        """A new job that continues `job_id` (ended FINISHED:ABORTED, EXECUTION_EXCEPTION or
        ABNORMAL) from its last completed round, submitted by the caller; its record's
        `resumed_from` names `job_id`. FailedPrecondition when the job is in another status
        or completed no round."""
        request = admin_pb2.ResumeJobRequest(job_id=job_id)
        reply = self._call(
            lambda: self._stub.ResumeJob(request, metadata=self._metadata, timeout=self.timeout)
        )
        return SubmitResult(reply.job_id)

    def delete(self, job_id: str) -> None:
        """Delete a job in a final status (its record and stored objects)."""
        request = admin_pb2.DeleteJobRequest(job_id=job_id)
        self._call(
            lambda: self._stub.DeleteJob(request, metadata=self._metadata, timeout=self.timeout)
        )

    def abort(self, job_id: str, reason: str = "") -> JobRecord:
        request = admin_pb2.AbortJobRequest(job_id=job_id, reason=reason)
        return record_from_proto(self._call(
            lambda: self._stub.AbortJob(request, metadata=self._metadata, timeout=self.timeout)
        ))

    def download(self, job_id: str, out: BinaryIO, *, result: bool = False) -> int:
        """Write the job's definition zip (or, with `result`, its result) to `out`; returns
        the number of bytes written."""
        request = admin_pb2.DownloadJobRequest(job_id=job_id, result=result)
        written = 0
        for chunk in self._stream(self._stub.DownloadJob(request, metadata=self._metadata)):
            out.write(chunk.data)
            written += len(chunk.data)
        return written

    def metrics(self, job_id: str) -> builtins.list[RoundMetrics]:
        """The rounds the job's workflows reported so far, oldest first (while the job runs,
        too): workflow, 0-based round, num_rounds, `metrics` ({"aggregate": {...}, "sites":
        {site: {...}}}) and when it was recorded. [] before the first round completes."""
        request = admin_pb2.GetJobMetricsRequest(job_id=job_id)
        reply = self._call(
            lambda: self._stub.GetJobMetrics(request, metadata=self._metadata,
                                             timeout=self.timeout)
        )
        return [round_from_proto(entry) for entry in reply.rounds]

    def logs(self, job_id: str, site: str | None = None, follow: bool = False, *,
             after: str = "") -> LogStream:
        """The job's log lines, oldest first (`fedhive.joblogs.wire.LogEntry`: id, site
        ("server" for the server job), source ("server" / "client_job": a client job or its
        trainer), line); only `site`'s ("server": the server job's) when given; after the line
        `after` when given (an id seen before). `follow`: go on with new lines as they come,
        until the job is final and every site that ran it sent its last line. The stream also
        says which sites do not share their logs (`LogStream.private_sites`)."""
        request = admin_pb2.JobLogsRequest(job_id=job_id, site=site or "", follow=follow,
                                           after=after)
        return LogStream(self._stream(self._stub.JobLogs(
            request, metadata=self._metadata, timeout=None if follow else self.timeout)))

    def watch(self, job_id: str) -> Iterator[JobRecord]:
        """The job's record now and after every status change; ends after a final status."""
        request = admin_pb2.GetJobRequest(job_id=job_id)
        for record in self._stream(self._stub.WatchJob(request, metadata=self._metadata)):
            yield record_from_proto(record)

    # -- operation-driven jobs (fedhive.sdk.operations) ---------------------------------------
    def start_operation_job(self, site_app: Path, *, sites: builtins.list[str] | None = None,
                            operators: Mapping[str, Any] | None = None,
                            components: builtins.list[dict[str, Any]] | None = None,
                            min_clients: int | None = None, name: str = "operations",
                            project: str = "", task_wait_time: float | None = None,
                            resource_spec: Mapping[str, Any] | None = None, job_id: str = "",
                            extra_meta: Mapping[str, Any] | None = None) -> SubmitResult:
        """Submit a job that runs the operations its callers ask for (`call_operation`) on
        `sites` (default: the sites online now) with `site_app`; see
        `operations.operation_job`."""
        from fedhive.sdk.operations import operation_job

        if not sites:
            sites = [site.name for site in self.sites() if site.online]
        archive = operation_job(site_app, name=name, sites=sites, operators=operators,
                                components=components, min_clients=min_clients,
                                resource_spec=resource_spec, project=project,
                                task_wait_time=task_wait_time, extra_meta=extra_meta)
        return self.submit(archive, job_id=job_id, submission_id=job_id)

    def call_operation(self, job_id: str, task_name: str, data: Dxo | Mapping[str, Any], *,
                       method: str = "", aggregator: str | None = None,
                       min_targets: int | None = None, timeout: float | None = None,
                       args: Mapping[str, Any] | None = None,
                       meta: Mapping[str, Any] | None = None, op_id: str = "",
                       read_wait: float = 10.0, wait: float | None = None) -> OperationResult:
        """Run one operation (`method` "bcast" or "relay"; "": the job's `operators` decide) of
        `task_name` with `data` (arrays: sent inline; a Dxo's refs pass to the sites
        untouched) on the job's sites; returns the aggregate (`OperationResult`). Raises
        FailedPrecondition when it failed, was not picked up within `read_wait` seconds, took
        longer than `wait`, or the job ended."""
        from fedhive.sdk.operations import request_for, run_until_done, to_dxo

        request = request_for(job_id, task_name, to_dxo(data, meta), method=method, op_id=op_id,
                              args={"aggregator": aggregator, "min_targets": min_targets,
                                    "timeout": timeout, **(args or {})})
        return run_until_done(self.run_operation, request, read_wait=read_wait, wait=wait,
                              alive=lambda: self._why_ended(job_id))

    def end_operation_job(self, job_id: str, *, read_wait: float = 10.0) -> None:
        """The job's caller is done: it ends FINISHED:COMPLETED."""
        from fedhive.sdk.operations import end_request, run_until_done

        request = end_request(job_id)
        run_until_done(self.run_operation, request, read_wait=read_wait,
                       alive=lambda: self._why_ended(job_id))

    def export_operation(self, request: operation_pb2.ExportRequest
                         ) -> operation_pb2.ExportReply:
        """Copy a finished operation's stored tensors to presigned targets (a hub site)."""
        reply: operation_pb2.ExportReply = self._call(
            lambda: self._stub.ExportOperationResult(request, metadata=self._metadata,
                                                     timeout=self.submit_timeout))
        return reply

    def run_operation(self, request: operation_pb2.OperationRequest
                      ) -> operation_pb2.OperationReply:
        """One RunOperation RPC, as it is (`call_operation` repeats it until done)."""
        reply: operation_pb2.OperationReply = self._call(
            lambda: self._stub.RunOperation(request, metadata=self._metadata,
                                            timeout=request.wait_ms / 1000 + self.timeout))
        return reply

    def _why_ended(self, job_id: str) -> str:
        from fedhive.sdk.operations import job_gone

        record = self.get(job_id)
        return job_gone(record.job_id, record.status.value, record.status_reason)

    # -- sites -----------------------------------------------------------------------------
    def sites(self) -> builtins.list[SiteInfo]:
        request = admin_pb2.ListSitesRequest()
        reply = self._call(
            lambda: self._stub.ListSites(request, metadata=self._metadata, timeout=self.timeout)
        )
        return [
            SiteInfo(site.last_heartbeat.site, site.online,
                     site_heartbeat_from_proto(site.last_heartbeat))
            for site in reply.sites
        ]
