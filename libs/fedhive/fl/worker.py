"""The client job's worker loop: get a task, run its executor, send the result back.

    worker = Worker(bus, executors, WorkerConfig(job_id, site, server_queue, workspace,
                    inline_threshold=settings.inline_threshold), abort=abort, log=log)
    worker.run()   # returns after END_RUN, or soon after `abort` is set

* Tasks come from a long poll (`GetTaskRequest` RPC on the job's server queue, waiting up to
  `wait_ms` server-side): no busy polling, and a new task reaches an idle site at once. A poll
  that times out or finds the broker away is retried with backoff, as long as it takes; the
  server's queue missing (the server job is still starting) is tolerated for
  `server_wait_s`, then the worker gives up with `FailedPrecondition`.
* The executor is chosen by task name (`Executors.get`, `"*"` matches all). No executor:
  `TASK_UNKNOWN`. An executor that raises, or returns something that is not a `Dxo`:
  `EXECUTION_EXCEPTION` with the error's one line (the traceback goes to the log); a
  `TaskError` gives its own return code. Task data that does not decode: `BAD_TASK_DATA`.
* The result's arrays go up inline or uploaded through grants (`fedhive.fl.result_packer`); a
  result that cannot be packed or uploaded becomes an `EXECUTION_EXCEPTION` result. The result
  is sent with `next_wait_ms`: its reply is the next assignment (the same long poll), so a task
  costs one round trip after the first poll.
* Each task's `server` channel makes the upload RPCs (`GrantUploadRequest` with sizes,
  `CompleteUploadRequest`) and `ResignRequest`; the worker's fetcher re-signs expired URLs
  through it.
* `abort` (SIGTERM in the client job) is handed to the executor; a result finished after it was
  set is not sent. When the run ends (END_RUN or abort) every executor's `finalize()`, if it has
  one, is called once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
from google.protobuf.message import Message

from fedhive.blobs import Attachment, PresignedFetcher, PresignedUploader, PresignedUrl
from fedhive.bus import Bus, Encoded
from fedhive.errors import FailedPrecondition, FedhiveError, RpcTimeout, Unavailable, Unroutable
from fedhive.fl.dxo import Dxo, dxo_from_proto
from fedhive.fl.executor import ExecTask, Executors, TaskError
from fedhive.fl.result_packer import ResultPacker
from fedhive.fl.tasks import ReturnCode
from fedhive.proto.v1 import common_pb2, task_pb2
from fedhive.retry import Backoff
from fedhive.structs import struct_to_dict

M = TypeVar("M", bound=Message)
_A = task_pb2.TaskAssignment
Received = tuple[task_pb2.TaskAssignment, memoryview]  # and its attachment (the task's arrays)
RETRY = Backoff(base=0.2, cap=5.0, max_attempts=None)
_TRANSIENT = (RpcTimeout, Unavailable)
# A site's WorkerExit may go out while the server side is still starting (its queue not there).
_EXIT_NOTICE = Backoff(base=0.05, cap=2.0, max_attempts=None, deadline=30.0)


@dataclass(frozen=True)
class WorkerConfig:
    job_id: str
    site: str
    server_queue: str
    workspace: Path
    inline_threshold: int
    inline_budget: int | None = None  # default 8 x inline_threshold
    wait_ms: int = 10_000  # long-poll budget the server may wait for work
    rpc_margin_s: float = 10.0  # on top of wait_ms: broker and server latency
    call_timeout_s: float = 60.0  # results and upload grants
    result_retry_s: float = 300.0  # how long a result is re-sent while the server is away
    server_wait_s: float = 120.0  # how long the server's queue may be missing


@dataclass(frozen=True)
class _Outcome:
    return_code: str
    dxo: Dxo | None = None
    error: str = ""


def one_line(err: BaseException, limit: int = 1000) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def send_worker_exit(bus: Bus, server_queue: str, job_id: str, site: str, error: str) -> None:
    """Tell the server side that `site` will serve no task (its executors did not build), retried
    while its queue is not there yet or the broker is away; raises the last error after 30 s."""
    notice = task_pb2.WorkerExit(job_id=job_id, site=site, error=error)
    _EXIT_NOTICE.call(lambda: bus.send(server_queue, notice), retry_on=(Unroutable, Unavailable))


class Worker:
    def __init__(self, bus: Bus, executors: Executors, config: WorkerConfig, *,
                 abort: threading.Event, log: Any, fetcher: PresignedFetcher | None = None,
                 uploader: PresignedUploader | None = None) -> None:
        self._bus = bus
        self._executors = executors
        self.config = config
        self.abort = abort
        self._log = log
        self._fetcher = fetcher or PresignedFetcher(resign=self.resign)
        self._uploader = uploader or PresignedUploader()
        self._packer = ResultPacker(self._fetcher, self._uploader,
                                    inline_threshold=config.inline_threshold,
                                    inline_budget=config.inline_budget)
        self.current_task = "waiting"  # what the client job's heartbeat reports
        self.tasks_done = 0

    def run(self) -> None:
        """Serve tasks until END_RUN (returns) or `abort` (returns soon after); then finalize
        the executors."""
        try:
            received: Received | None = None
            while not self.abort.is_set():
                if received is None:
                    received = self._poll()
                if received is None or received[0].kind == _A.KIND_END_RUN:
                    if received is not None:
                        self._log.info("worker.end_run", tasks_done=self.tasks_done)
                        self.current_task = "ended"
                    return
                if received[0].kind == _A.KIND_TASK:
                    received = self._serve(*received)  # what the result's reply brought
                    continue
                if received[0].retry_after_ms > 0:
                    self.abort.wait(received[0].retry_after_ms / 1000)
                received = None
        finally:
            self._finalize()

    def _finalize(self) -> None:
        seen: set[int] = set()
        for executor in self._executors.by_task.values():
            finalize = getattr(executor, "finalize", None)
            if id(executor) in seen or not callable(finalize):
                continue
            seen.add(id(executor))
            try:
                finalize()
            except Exception as err:  # one executor's cleanup must not stop the others'
                self._log.error("worker.finalize_failed", executor=type(executor).__name__,
                                error=one_line(err), exc_info=True)

    # one task -----------------------------------------------------------------------------
    def _serve(self, assignment: task_pb2.TaskAssignment, attached: memoryview,
               ) -> Received | None:
        """Run the task and send its result, which asks for the next assignment too: returns
        that, or None when there is none to return (the worker then polls)."""
        name, task_id = assignment.task_name, assignment.task_id
        log = self._log.bind(task=name, task_id=task_id)
        self.current_task = name
        started = time.monotonic()
        with structlog.contextvars.bound_contextvars(task_id=task_id):  # libraries' lines too
            outcome = self._execute(assignment, attached, log)
        if self.abort.is_set():
            log.info("worker.result_dropped", why="the client job is stopping")
            return None
        result = task_pb2.TaskResult(job_id=self.config.job_id, site=self.config.site,
                                     task_id=task_id, task_name=name,
                                     return_code=outcome.return_code, error=outcome.error,
                                     next_wait_ms=self.config.wait_ms)
        attachment = Attachment()  # the inline arrays' bytes, sent after the message
        if outcome.dxo is not None:
            try:
                self._packer.pack(outcome.dxo, _Channel(self, task_id), into=result.data,
                                  attachment=attachment)
            except Exception as err:  # anything the result holds that cannot be sent
                log.error("worker.result_not_packed", error=one_line(err), exc_info=True)
                result.ClearField("data")
                result.return_code = ReturnCode.EXECUTION_EXCEPTION
                result.error = f"result could not be sent: {one_line(err)}"
                attachment = Attachment()
        self.tasks_done += 1
        self.current_task = "waiting"
        log.info("worker.task_done", return_code=result.return_code,
                 seconds=round(time.monotonic() - started, 3))
        return self._submit(result, attachment, log)

    def _execute(self, assignment: task_pb2.TaskAssignment, attached: memoryview, log: Any,
                 ) -> _Outcome:
        executor = self._executors.get(assignment.task_name)
        if executor is None:
            log.warning("worker.task_unknown")
            return _Outcome(ReturnCode.TASK_UNKNOWN,
                            error=f"site {self.config.site} has no executor for task "
                                  f"{assignment.task_name!r}")
        try:
            data = dxo_from_proto(assignment.data, attached)
        except FedhiveError as err:
            log.warning("worker.bad_task_data", error=str(err))
            return _Outcome(ReturnCode.BAD_TASK_DATA, error=one_line(err))
        task = ExecTask(name=assignment.task_name, data=data,
                        props=struct_to_dict(assignment.props), job_id=self.config.job_id,
                        site=self.config.site, workspace=self.config.workspace,
                        abort=self.abort, log=log, fetcher=self._fetcher,
                        task_id=assignment.task_id, timeout=assignment.timeout_ms / 1000,
                        server=_Channel(self, assignment.task_id),
                        inline_threshold=self.config.inline_threshold,
                        inline_budget=self.config.inline_budget,
                        components=self._executors.components)
        try:
            out = executor.execute(task)
        except TaskError as err:
            log.error("worker.task_failed", return_code=err.return_code, error=str(err))
            return _Outcome(err.return_code, error=str(err))
        except Exception as err:  # an executor's failure is the task's, not the worker's
            log.error("worker.executor_failed", error=one_line(err), exc_info=True)
            return _Outcome(ReturnCode.EXECUTION_EXCEPTION, error=one_line(err))
        if not isinstance(out, Dxo):
            return _Outcome(ReturnCode.EXECUTION_EXCEPTION,
                            error=f"{type(executor).__name__}.execute returned a "
                                  f"{type(out).__name__}, not a Dxo")
        return _Outcome(ReturnCode.OK, out)

    # RPCs ---------------------------------------------------------------------------------
    def _poll(self) -> Received | None:
        """The next assignment; None once aborted. Raises a permanent error (e.g. refused)."""
        config = self.config
        request = task_pb2.GetTaskRequest(job_id=config.job_id, site=config.site,
                                          wait_ms=config.wait_ms)
        timeout = config.wait_ms / 1000 + config.rpc_margin_s
        delays = RETRY.delays()
        missing_since: float | None = None
        while not self.abort.is_set():
            try:
                return self._bus.call_attached(config.server_queue, request, _A,
                                               timeout=timeout)
            except Unroutable as err:
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > config.server_wait_s:
                    raise FailedPrecondition(
                        f"the job's server queue {config.server_queue} has not existed for "
                        f"{config.server_wait_s:g} s: the server job is gone", field="queue",
                    ) from err
                self._pause(delays, err)
            except _TRANSIENT as err:
                missing_since = None
                self._pause(delays, err)
        return None

    def grant(self, task_id: str, checksums: list[str], sizes: list[int],
              ) -> task_pb2.UploadGrant:
        request = task_pb2.GrantUploadRequest(job_id=self.config.job_id, site=self.config.site,
                                              task_id=task_id, checksums=checksums,
                                              sizes=sizes)
        return self._call(request, task_pb2.UploadGrant)[0]

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        request = task_pb2.CompleteUploadRequest(job_id=self.config.job_id,
                                                 site=self.config.site, key=key,
                                                 upload_id=upload_id, etags=etags)
        self._call(request, common_pb2.Ack)

    def resign(self, keys: list[str]) -> dict[str, PresignedUrl]:
        request = task_pb2.ResignRequest(job_id=self.config.job_id, site=self.config.site,
                                         keys=keys)
        reply, _ = self._call(request, task_pb2.ResignReply)
        return {url.key: PresignedUrl(url.url, url.url_expires_at_ms) for url in reply.urls}

    def _submit(self, result: task_pb2.TaskResult, attachment: Attachment, log: Any,
                ) -> Received | None:
        """Send the result (with its attachment); the reply is the next assignment (None if
        the result could not be delivered)."""
        request = Encoded.attaching(task_pb2.TaskResult, result.SerializeToString(),
                                    attachment.parts)
        try:
            assignment, attached = self._call(request, _A, wait_s=result.next_wait_ms / 1000)
        except FedhiveError as err:  # the server re-sends the task if it still wants it
            log.error("worker.result_not_delivered", error=str(err))
            return None
        if not assignment.result.accepted:
            log.warning("worker.result_refused", reason=assignment.result.reason)
        return assignment, attached

    def _call(self, request: Message | Encoded, reply_type: type[M], *,
              wait_s: float = 0.0) -> tuple[M, memoryview]:
        """An RPC retried while the server is away, up to `result_retry_s`; `wait_s`: how long
        the server may hold it (a long poll) on top of `call_timeout_s`. The reply and its
        attachment."""
        deadline = time.monotonic() + self.config.result_retry_s
        delays = RETRY.delays()
        while True:
            try:
                return self._bus.call_attached(self.config.server_queue, request, reply_type,
                                               timeout=self.config.call_timeout_s + wait_s)
            except _TRANSIENT as err:
                if time.monotonic() > deadline or self.abort.is_set():
                    raise
                self._pause(delays, err)

    def _pause(self, delays: Iterator[float], err: FedhiveError) -> None:
        wait = next(delays)
        self._log.info("worker.server_unreachable", error=str(err), retry_in=round(wait, 2))
        self.abort.wait(wait)


class _Channel:
    """A task's `ServerChannel`: the worker's RPCs, on behalf of that task."""

    def __init__(self, worker: Worker, task_id: str) -> None:
        self._worker = worker
        self.task_id = task_id

    def grant(self, checksums: list[str], sizes: list[int]) -> task_pb2.UploadGrant:
        return self._worker.grant(self.task_id, checksums, sizes)

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        self._worker.complete(key, upload_id, etags)

    def resign(self, keys: list[str]) -> dict[str, PresignedUrl]:
        return self._worker.resign(keys)
