"""The gRPC edge of the gateway: authenticate, decode, call `Gateway`, translate errors.

Authentication reads `authorization: Bearer <token>` from the call metadata. A `FedhiveError`
becomes a gRPC status once, here (`fedhive.sdk.status.to_grpc`: code, one-line message, and
the fedhive code as trailing metadata for the SDK). Anything else is a bug: logged with its
traceback, answered as INTERNAL without details.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from fedhive.auth import Admin, AdminDirectory
from fedhive.errors import FedhiveError
from fedhive.proto.v1 import admin_pb2, admin_pb2_grpc, job_pb2, operation_pb2
from fedhive.sdk.status import to_grpc

from .handlers import Gateway

T = TypeVar("T")
_BEARER = "bearer "


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, gateway: Gateway, admins: AdminDirectory, log: Any) -> None:
        self._gateway = gateway
        self._admins = admins
        self._log = log

    # -- the edge --------------------------------------------------------------------------
    def _caller(self, context: grpc.ServicerContext) -> Admin:
        token = None
        for key, value in context.invocation_metadata():
            if key == "authorization" and isinstance(value, str):
                token = value[len(_BEARER):] if value.lower().startswith(_BEARER) else value
        try:
            return self._admins.authenticate(token.strip() if token else None)
        except FedhiveError as err:
            self._log.info("authn.denied", peer=context.peer(), reason=err.message)
            raise

    def _abort(self, context: grpc.ServicerContext, err: BaseException, method: str) -> NoReturn:
        if isinstance(err, FedhiveError):
            code, message, trailers = to_grpc(err)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        self._log.error("rpc.failed", method=method, exc_info=err)
        context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error (see the gateway log)")
        raise AssertionError("grpc's context.abort() always raises")  # for the type checker

    def _unary(self, context: grpc.ServicerContext, method: str, call: Callable[[Admin], T]
               ) -> T:
        try:
            return call(self._caller(context))
        except Exception as err:  # the one translation point
            self._abort(context, err, method)

    def _stream(self, context: grpc.ServicerContext, method: str,
                call: Callable[[Admin], Iterator[T]]) -> Iterator[T]:
        try:
            yield from call(self._caller(context))
        except Exception as err:
            self._abort(context, err, method)

    # -- AdminService ----------------------------------------------------------------------
    def SubmitJob(self, request_iterator: Iterator[admin_pb2.SubmitJobChunk],
                  context: grpc.ServicerContext) -> admin_pb2.SubmitJobReply:
        return self._unary(context, "SubmitJob",
                           lambda admin: self._gateway.submit(admin, request_iterator))

    def ListJobs(self, request: admin_pb2.ListJobsRequest,
                 context: grpc.ServicerContext) -> admin_pb2.ListJobsReply:
        return self._unary(context, "ListJobs",
                           lambda admin: self._gateway.list_jobs(admin, request))

    def GetJob(self, request: admin_pb2.GetJobRequest,
               context: grpc.ServicerContext) -> job_pb2.JobRecord:
        return self._unary(context, "GetJob",
                           lambda admin: self._gateway.get_job(admin, request.job_id))

    def GetJobMetrics(self, request: admin_pb2.GetJobMetricsRequest,
                      context: grpc.ServicerContext) -> admin_pb2.JobMetrics:
        return self._unary(context, "GetJobMetrics",
                           lambda admin: self._gateway.job_metrics(admin, request.job_id))

    def AbortJob(self, request: admin_pb2.AbortJobRequest,
                 context: grpc.ServicerContext) -> job_pb2.JobRecord:
        return self._unary(context, "AbortJob",
                           lambda admin: self._gateway.abort_job(admin, request))

    def CloneJob(self, request: admin_pb2.CloneJobRequest,
                 context: grpc.ServicerContext) -> admin_pb2.SubmitJobReply:
        return self._unary(context, "CloneJob",
                           lambda admin: self._gateway.clone_job(admin, request.job_id))

    def ResumeJob(self, request: admin_pb2.ResumeJobRequest,
                  context: grpc.ServicerContext) -> admin_pb2.SubmitJobReply:
        return self._unary(context, "ResumeJob",
                           lambda admin: self._gateway.resume_job(admin, request.job_id))

    def DeleteJob(self, request: admin_pb2.DeleteJobRequest,
                  context: grpc.ServicerContext) -> admin_pb2.DeleteJobReply:
        return self._unary(context, "DeleteJob",
                           lambda admin: self._gateway.delete_job(admin, request.job_id))

    def DownloadJob(self, request: admin_pb2.DownloadJobRequest,
                    context: grpc.ServicerContext) -> Iterator[admin_pb2.DataChunk]:
        def chunks(admin: Admin) -> Iterator[admin_pb2.DataChunk]:
            for data in self._gateway.download_job(admin, request):
                yield admin_pb2.DataChunk(data=data)

        return self._stream(context, "DownloadJob", chunks)

    def WatchJob(self, request: admin_pb2.GetJobRequest,
                 context: grpc.ServicerContext) -> Iterator[job_pb2.JobRecord]:
        return self._stream(
            context, "WatchJob",
            lambda admin: self._gateway.watch_job(admin, request.job_id, context.is_active),
        )

    def JobLogs(self, request: admin_pb2.JobLogsRequest,
                context: grpc.ServicerContext) -> Iterator[admin_pb2.JobLogPage]:
        return self._stream(
            context, "JobLogs",
            lambda admin: self._gateway.job_logs(admin, request, context.is_active),
        )

    def RunOperation(self, request: operation_pb2.OperationRequest,
                     context: grpc.ServicerContext) -> operation_pb2.OperationReply:
        return self._unary(context, "RunOperation",
                           lambda admin: self._gateway.run_operation(admin, request))

    def ExportOperationResult(self, request: operation_pb2.ExportRequest,
                              context: grpc.ServicerContext) -> operation_pb2.ExportReply:
        return self._unary(context, "ExportOperationResult",
                           lambda admin: self._gateway.export_operation(admin, request))

    def ListSites(self, request: admin_pb2.ListSitesRequest,
                  context: grpc.ServicerContext) -> admin_pb2.ListSitesReply:
        return self._unary(context, "ListSites", lambda admin: self._gateway.list_sites(admin))
