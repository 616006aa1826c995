"""The server job's side of the task transport: what it answers on its job queue.

Messages (`Names.job_server_queue(job_id)`, see proto/fedhive/v1/task.proto):

* `GetTaskRequest` (RPC, site): a long poll. The next assignment from the task manager, waiting
  up to `wait_ms` (at most `max_wait_s`) for work to appear; `TRY_AGAIN` when none did,
  `END_RUN` once the run is over. Task data goes out as refs with presigned GET URLs: a task's
  arrays are packed once (`ctx.codec.pack`, cached per task until it is replaced or done), and
  refs without a URL (a site's result forwarded to the next site) are presigned.
* `TaskResult` (RPC, site): handed to `tasks.submit`; the reply says whether it was accepted
  and why not. The DXO stays lazy (workflows materialize it with the credentialed store, which
  verifies checksums); a non-inline ref must name the content key of its own checksum under
  this job's tensor prefix (what a grant gives out), and its URL is dropped (a site must not
  choose the URL other sites will read). A result whose data is malformed reaches the task
  manager as an `EXECUTION_RESULT_ERROR` result, so the workflow sees the site failed.
* `GrantUploadRequest` (RPC, site): presigned PUT URLs for the content keys
  `{tensor prefix}sha256/<hex>` of the given checksums; `present` for objects already stored.
* `WorkerExit` (site): its client job could not start (bad executor config): the site is gone.
* `SiteGone` (job-runner): the site stopped reporting the job or went offline.

Sender identity: every site message's AMQP `user_id` (verified by RabbitMQ) must be the site it
names, a site of this job; a `SiteGone` must come from the services' own broker user (the one
the SJ itself connects as, shared with the runner). Anything else is `PermissionDenied`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import Message

from fedhive.blobs import TensorRef
from fedhive.bus import Delivery
from fedhive.errors import FedhiveError, InvalidArgument, PermissionDenied
from fedhive.fl.dxo import Dxo, dxo_from_proto, dxo_to_proto
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, Result, ReturnCode, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.proto.v1 import runner_pb2, task_pb2
from fedhive.structs import dict_to_struct

WAIT_SLICE_S = 0.2  # re-ask the manager this often: time alone can make a site eligible
URL_TTL_S = 3600
URL_MARGIN_MS = 600_000  # re-sign a cached URL that would expire within 10 minutes
MAX_GRANT = 10_000  # checksums per GrantUploadRequest
_SHA256 = re.compile(r"^sha256:([0-9a-f]{64})$")
_A = task_pb2.TaskAssignment


def content_key(prefix: str, checksum: str) -> str:
    """Where an uploaded array with this checksum lives; InvalidArgument for a checksum that
    is not `sha256:<64 lowercase hex>`."""
    match = _SHA256.match(checksum)
    if match is None:
        raise InvalidArgument(f"checksum {checksum[:80]!r} is not 'sha256:<64 hex digits>'",
                              field="checksum")
    return f"{prefix}sha256/{match.group(1)}"


class TaskServer:
    ACCEPTS: tuple[type[Message], ...] = (
        task_pb2.GetTaskRequest, task_pb2.TaskResult, task_pb2.GrantUploadRequest,
        task_pb2.WorkerExit, runner_pb2.SiteGone,
    )

    def __init__(self, ctx: WorkflowContext, *, service_user: str, max_wait_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert ctx.tasks is not None and ctx.store is not None and ctx.codec is not None
        self.ctx = ctx
        self.tasks: TaskManager = ctx.tasks
        self._store = ctx.store
        self._codec = ctx.codec
        self._service_user = service_user
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._packed: dict[str, _Packed] = {}  # task id -> its arrays' refs
        self._packing: dict[str, threading.Lock] = {}
        self._ended: set[str] = set()  # sites told END_RUN, or gone

    # bus entry point ----------------------------------------------------------------------
    def handle(self, message: Message, delivery: Delivery) -> Message | None:
        if isinstance(message, runner_pb2.SiteGone):
            self.site_gone(message, delivery.user_id)
            return None
        site = self._sender(message, delivery.user_id)
        if isinstance(message, task_pb2.GetTaskRequest):
            return self.get_task(site, message.wait_ms)
        if isinstance(message, task_pb2.TaskResult):
            return self.submit(site, message)
        if isinstance(message, task_pb2.GrantUploadRequest):
            return self.grant_upload(site, list(message.checksums))
        assert isinstance(message, task_pb2.WorkerExit)
        self.worker_exit(site, message.error)
        return None

    def _sender(self, message: Any, user_id: str | None) -> str:
        site: str = message.site
        if user_id != site:
            raise PermissionDenied(f"{type(message).__name__} for site {site!r} refused: sent "
                                   f"by broker user {user_id or '(none)'!r}", field="user_id")
        if site not in self.ctx.sites:
            raise PermissionDenied(f"site {site!r} is not a site of job {self.ctx.job_id}",
                                   field="site")
        if message.job_id != self.ctx.job_id:
            raise InvalidArgument(f"message for job {message.job_id!r} reached job "
                                  f"{self.ctx.job_id}", field="job_id")
        return site

    # handlers -----------------------------------------------------------------------------
    def get_task(self, site: str, wait_ms: int) -> task_pb2.TaskAssignment:
        deadline = self._clock() + min(max(wait_ms, 0) / 1000, self._max_wait_s)
        while True:
            assignment = self.tasks.next_task(site)
            if assignment.kind == "task":
                assert assignment.client_task is not None and assignment.data is not None
                return self._assignment(assignment.client_task, assignment.data)
            if assignment.kind == "end_run":
                with self._lock:
                    self._ended.add(site)
                return _A(kind=_A.KIND_END_RUN)
            left = deadline - self._clock()
            if left <= 0 or self.ctx.abort.is_set():
                return _A(kind=_A.KIND_TRY_AGAIN)
            self.tasks.wait_for_work(min(left, WAIT_SLICE_S), site)

    def submit(self, site: str, message: task_pb2.TaskResult) -> task_pb2.TaskResultReply:
        problem = ""
        dxo: Dxo | None = None
        try:
            if not message.return_code:
                raise InvalidArgument("the result has no return_code", field="return_code")
            if message.HasField("data"):
                dxo = self._checked(dxo_from_proto(message.data))
        except FedhiveError as err:
            problem = f"result data rejected: {err}"
        if problem:
            self.ctx.log.warning("task_server.bad_result", site=site, task_id=message.task_id,
                                 reason=problem)
            result = Result(ReturnCode.EXECUTION_RESULT_ERROR, None, problem)
        else:
            result = Result(message.return_code, dxo, " ".join(message.error.split()))
        submission = self.tasks.submit(site, message.task_id, result)
        accepted = submission.accepted and not problem
        return task_pb2.TaskResultReply(accepted=accepted,
                                        reason=problem or ("" if accepted else submission.reason))

    def grant_upload(self, site: str, checksums: list[str]) -> task_pb2.UploadGrant:
        if len(checksums) > MAX_GRANT:
            raise InvalidArgument(f"{len(checksums)} checksums in one grant request (at most "
                                  f"{MAX_GRANT})", field="checksums")
        grant = task_pb2.UploadGrant()
        for checksum in checksums:
            key = content_key(self.ctx.tensor_prefix, checksum)
            target = grant.targets.add(checksum=checksum, key=key)
            if self._store.exists(key):
                target.present = True
            else:
                url = self._store.presign_put(key, URL_TTL_S)
                target.url, target.url_expires_at_ms = url.url, url.expires_at_ms
        self.ctx.log.debug("task_server.upload_granted", site=site, objects=len(checksums))
        return grant

    def worker_exit(self, site: str, error: str) -> None:
        reason = f"client job could not start: {' '.join(error.split())}"
        self.ctx.log.warning("task_server.worker_exit", site=site, reason=reason)
        self._gone(site, reason)

    def site_gone(self, message: runner_pb2.SiteGone, user_id: str | None) -> None:
        if user_id != self._service_user:
            raise PermissionDenied(f"SiteGone refused: sent by broker user "
                                   f"{user_id or '(none)'!r}, not the services' user",
                                   field="user_id")
        if message.job_id != self.ctx.job_id or message.site not in self.ctx.sites:
            self.ctx.log.warning("task_server.site_gone_ignored", job_id=message.job_id,
                                 site=message.site)
            return
        self.ctx.log.warning("server_job.site_gone", site=message.site, reason=message.reason)
        self._gone(message.site, message.reason)

    def all_ended(self) -> bool:
        """Every site of the job was told END_RUN or is gone."""
        with self._lock:
            return set(self.ctx.sites) <= self._ended

    # internals ----------------------------------------------------------------------------
    def _gone(self, site: str, reason: str) -> None:
        self.ctx.site_gone(site, reason)
        self.tasks.site_gone(site)
        with self._lock:
            self._ended.add(site)

    def _checked(self, dxo: Dxo) -> Dxo:
        """Refs a site may send: inline, or at the content key of their checksum, URL dropped."""
        for name, ref in list(dxo.data.items()):
            if not isinstance(ref, TensorRef) or ref.is_inline:
                continue
            if ref.key != content_key(self.ctx.tensor_prefix, ref.checksum) or ref.offset:
                raise InvalidArgument(f"tensor {name!r}: key {ref.key[:200]!r} is not the "
                                      "upload key granted for its checksum", field=name)
            dxo.data[name] = replace(ref, url="", url_expires_at_ms=0)
        return dxo

    def _assignment(self, client_task: ClientTask, data: Dxo) -> task_pb2.TaskAssignment:
        task = client_task.task
        return _A(kind=_A.KIND_TASK, task_id=client_task.id, task_name=task.name,
                  data=self._task_data(task, data), props=dict_to_struct(task.props),
                  timeout_ms=int(task.timeout * 1000))

    def _task_data(self, task: Task, data: Dxo) -> task_pb2.Dxo:
        """The data as sent: its arrays packed once per task (again only when the workflow
        gave the task other arrays, as the cyclic relay does between sends), refs without a
        fresh URL (a site's result forwarded to the next site) presigned."""
        arrays = {name: value for name, value in data.data.items()
                  if not isinstance(value, TensorRef)}
        identity = {name: id(value) for name, value in arrays.items()}
        standing = {t.id for t in self.tasks.standing()} | {task.id}
        with self._lock:
            for task_id in [t for t in self._packed if t not in standing]:
                del self._packed[task_id]
                self._packing.pop(task_id, None)
            lock = self._packing.setdefault(task.id, threading.Lock())
        with lock:  # sites asking at once for a new broadcast: one packs, the others wait
            with self._lock:
                cached = self._packed.get(task.id)
            if cached is None or cached.identity != identity:
                refs = self._codec.pack(arrays, self.ctx.tensor_prefix) if arrays else []
                cached = _Packed(identity, arrays, {ref.name: ref for ref in refs})
                with self._lock:
                    self._packed[task.id] = cached
        packed = cached.refs
        message = dxo_to_proto(data, lambda values: [packed[name] for name in values])
        now_ms = int(time.time() * 1000)
        for ref in message.tensors:
            if ref.key and ref.url_expires_at_ms - now_ms < URL_MARGIN_MS:
                url = self._store.presign_get(ref.key, URL_TTL_S)
                ref.url, ref.url_expires_at_ms = url.url, url.expires_at_ms
        return message


@dataclass(frozen=True)
class _Packed:
    identity: dict[str, int]  # name -> id() of the array packed
    arrays: dict[str, Any]  # holds those arrays, so their ids stay theirs
    refs: dict[str, TensorRef]
