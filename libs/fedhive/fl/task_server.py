"""The server job's side of the task transport: what it answers on its job queue.

Messages (`Names.job_server_queue(job_id)`, see proto/fedhive/v1/task.proto):

* `GetTaskRequest` (RPC, site): a long poll. The next assignment from the task manager, waiting
  up to `wait_ms` (at most `max_wait_s`) for work to appear; `TRY_AGAIN` when none did,
  `END_RUN` once the run is over. A poll with nothing to give yet is parked (a
  `fedhive.bus.Pending`: no thread waits for it) and answered by one dispatcher thread when a
  change of the task manager concerns its site (a new task, a turn, the end of the run: a
  broadcast is handed out by that thread, one site after the other, without waking a thread per
  site), or at its deadline (looked at every WAIT_SLICE_S, as all of them are while the job
  aborts or a send's or relay's turns open by the clock). A task's data is encoded once for
  all its sites (`fedhive.fl.task_data`: arrays packed, refs presigned), each site's own part
  (task id, props, the verdict) beside it.
* `TaskResult` (RPC, site): handed to `tasks.submit`; the reply says whether it was accepted
  and why not. With `next_wait_ms` the reply is the site's next assignment (the long poll
  above, parked the same way) carrying that verdict: one round trip per task instead of two.
  The DXO stays lazy (workflows materialize it with the credentialed store, which
  verifies checksums). Its refs must be ones the site may name (`fedhive.fl.uploads`: the
  server's objects, the site's own uploads, or what its task handed it), URL dropped, and name
  objects that exist with the refs' lengths. A result whose data is malformed or whose object
  is missing reaches the task manager as an `EXECUTION_RESULT_ERROR` result with a reason
  naming the job, site, task and round, so the workflow sees the site failed.
* `GrantUploadRequest`, `CompleteUploadRequest`, `ResignRequest` (RPC, site): where a site may
  upload the results of its open tasks (assigned, result not in yet), and fresh URLs for what
  it may read: answered by the job's `Uploads` (`fedhive.fl.uploads`), which this server tells
  of every assignment and result.
* `WorkerExit` (site): its client job could not start (bad executor config): the site is gone.
* `SiteGone` (job-runner): the site stopped reporting the job or went offline.

Sender identity: the queue is bound, besides its own name (the runner's `SiteGone`), with one
routing key per site of the job (`Names.job_site_route`), the only keys a site's broker user
may publish task traffic with: a site reaches the server jobs of its own jobs and no other. The
consumer takes messages only from those sites' broker users and the services' own; every site
message's AMQP `user_id` (verified by RabbitMQ) must then be the broker user of the site it
names, a site of this job, and a `SiteGone` must come from the services' own broker user (the
one the SJ itself connects as, shared with the runner). Anything else is `PermissionDenied`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import Message

from fedhive.bus import Bus, Delivery, Encoded, Pending, Senders, Subscription
from fedhive.bus.codec import error_message
from fedhive.errors import FedhiveError, InvalidArgument, PermissionDenied
from fedhive.fl.dxo import Dxo, MetaKey, dxo_from_proto
from fedhive.fl.operation_desk import OperationDesk
from fedhive.fl.task_data import FAN_OUT_BUDGET, TaskData
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, Result, ReturnCode
from fedhive.fl.uploads import UPLOAD_PART_SIZE, URL_TTL_S, Uploads
from fedhive.fl.workflow import WorkflowContext
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, operation_pb2, runner_pb2, task_pb2
from fedhive.structs import dict_to_struct

WAIT_SLICE_S = 0.2  # look at every parked poll this often: time alone can make a site eligible
_A = task_pb2.TaskAssignment


class TaskServer:
    ACCEPTS: tuple[type[Message], ...] = (
        task_pb2.GetTaskRequest, task_pb2.TaskResult, task_pb2.GrantUploadRequest,
        task_pb2.CompleteUploadRequest, task_pb2.ResignRequest, task_pb2.WorkerExit,
        runner_pb2.SiteGone, operation_pb2.OperationRequest, operation_pb2.ExportRequest,
    )

    def __init__(self, ctx: WorkflowContext, *, service_user: str, max_wait_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, url_ttl_s: int = URL_TTL_S,
                 upload_part_size: int = UPLOAD_PART_SIZE, check_workers: int = 8,
                 fan_out_budget: int = FAN_OUT_BUDGET) -> None:
        assert ctx.tasks is not None and ctx.store is not None and ctx.codec is not None
        self.ctx = ctx
        self.tasks: TaskManager = ctx.tasks
        self._service_user = service_user
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._task_data = TaskData(ctx, url_ttl_s=url_ttl_s, fan_out_budget=fan_out_budget)
        self.uploads = Uploads(ctx, url_ttl_s=url_ttl_s, upload_part_size=upload_part_size,
                               check_workers=check_workers)
        self.desk = OperationDesk(ctx, ctx.store, ctx.codec, url_ttl_s=url_ttl_s,
                                  max_wait_s=max_wait_s)
        self._lock = threading.Lock()  # guards the three below: handler threads share them
        self._ended: set[str] = set()  # sites told END_RUN, or gone
        self._polls: dict[str, _Poll] = {}  # site -> its parked long poll
        self._dispatcher: threading.Thread | None = None  # started with the first parked poll
        self._wake = threading.Event()  # a change concerns a parked poll: the dispatcher looks
        self._closed = threading.Event()
        self.tasks.on_change(self._noted)

    # bus entry point ----------------------------------------------------------------------
    def serve(self, bus: Bus, queue: str, *, handlers: int) -> Subscription:
        """Answer `queue` (the job's task queue) with `handlers` threads, on a queue that is
        not replicated (why: `fedhive.bus.topology`), reached by the job's sites only. Its
        prefetch leaves room for a parked long poll and a result of every site besides."""
        names = self._names
        return bus.serve(
            queue, self.handle, self.ACCEPTS, prefetch=2 * len(self.ctx.sites) + handlers,
            concurrency=handlers,
            replicated=False,
            quick=self.quick,
            binding_keys=[names.job_site_route(self.ctx.job_id, site) for site in self.ctx.sites],
            senders=Senders.only(self._service_user,
                                 *(names.site_user(site) for site in self.ctx.sites)))

    @property
    def _names(self) -> Names:
        assert self.ctx.names is not None
        return self.ctx.names

    @staticmethod
    def quick(message: Message) -> bool:
        """A result whose arrays all came inline: checked and folded, and its long poll parked
        (or answered from the encoded task data), on the consumer's own thread; one naming
        stored objects, which S3 must confirm, goes to a handler thread."""
        return isinstance(message, task_pb2.TaskResult) and not any(
            tensor.key for tensor in message.data.tensors)

    def handle(self, message: Message, delivery: Delivery) -> Message | Encoded | Pending | None:
        if isinstance(message, runner_pb2.SiteGone):
            self.site_gone(message, delivery.user_id)
            return None
        if isinstance(message, operation_pb2.OperationRequest | operation_pb2.ExportRequest):
            self._from_services(message, delivery.user_id)
            if isinstance(message, operation_pb2.OperationRequest):
                return self.desk.operate(message)
            return self.desk.export(message)
        site = self._sender(message, delivery.user_id)
        if isinstance(message, task_pb2.GetTaskRequest):
            return self.get_task(site, message.wait_ms)
        if isinstance(message, task_pb2.TaskResult):
            verdict = self.submit(site, message, delivery.attachment)
            if message.next_wait_ms <= 0:
                return verdict
            return self.get_task(site, message.next_wait_ms, verdict)
        if isinstance(message, task_pb2.GrantUploadRequest):
            return self.grant_upload(site, list(message.checksums), list(message.sizes),
                                     message.task_id)
        if isinstance(message, task_pb2.CompleteUploadRequest):
            return self.complete_upload(site, message)
        if isinstance(message, task_pb2.ResignRequest):
            return self.resign(site, list(message.keys))
        assert isinstance(message, task_pb2.WorkerExit)
        self.worker_exit(site, message.error)
        return None

    def _from_services(self, message: Any, user_id: str | None) -> None:
        """Operations come from the gateway, as the services' broker user, for this job."""
        if user_id != self._service_user:
            raise PermissionDenied(f"{type(message).__name__} refused: sent by broker user "
                                   f"{user_id or '(none)'!r}", field="user_id")
        if message.job_id != self.ctx.job_id:
            raise InvalidArgument(f"message for job {message.job_id!r} reached job "
                                  f"{self.ctx.job_id}", field="job_id")

    def _sender(self, message: Any, user_id: str | None) -> str:
        site: str = message.site
        if user_id != self._names.site_user(site):
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
    def get_task(self, site: str, wait_ms: int,
                 verdict: task_pb2.TaskResultReply | None = None,
                 ) -> task_pb2.TaskAssignment | Encoded | Pending:
        """The site's next assignment, with `verdict` (on the result this call answers) in it;
        when it has none yet, a `Pending` answered once it has one, or TRY_AGAIN after
        `wait_ms` (at most `max_wait_s`)."""
        reply = self._answer(site, verdict)
        if reply is not None:
            return reply
        wait = min(max(wait_ms, 0) / 1000, self._max_wait_s)
        if wait <= 0 or self.ctx.abort.is_set() or self._closed.is_set():
            return _A(kind=_A.KIND_TRY_AGAIN, result=verdict)
        poll = _Poll(Pending(), self._clock() + wait, verdict)
        self._park(site, poll)
        if self.tasks.changed_for([site]):  # a change since `_answer`, maybe already looked at
            self._serve(site)
        return poll.pending

    def close(self) -> None:
        """Stop the dispatcher; every poll still parked is answered TRY_AGAIN."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            dispatcher, polls = self._dispatcher, list(self._polls.values())
            self._polls.clear()
        if dispatcher is not None:
            dispatcher.join()
        for poll in polls:
            poll.pending.complete(_A(kind=_A.KIND_TRY_AGAIN, result=poll.verdict))

    def submit(self, site: str, message: task_pb2.TaskResult,
               attachment: bytes | memoryview = b"") -> task_pb2.TaskResultReply:
        problem = ""
        dxo: Dxo | None = None
        try:
            if not message.return_code:
                raise InvalidArgument("the result has no return_code", field="return_code")
            if message.HasField("data"):
                dxo = self.uploads.checked(dxo_from_proto(message.data, attachment), site,
                                           message.task_id)
        except FedhiveError as err:
            problem = f"result data rejected: {self.uploads.where(site, message.task_id)}: {err}"
        finally:
            self.uploads.closed(site, message.task_id)
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

    def grant_upload(self, site: str, checksums: list[str], sizes: list[int] | None = None,
                     task_id: str = "") -> task_pb2.UploadGrant:
        return self.uploads.grant_upload(site, checksums, sizes, task_id)

    def complete_upload(self, site: str, message: task_pb2.CompleteUploadRequest,
                        ) -> common_pb2.Ack:
        return self.uploads.complete_upload(site, message)

    def resign(self, site: str, keys: list[str]) -> task_pb2.ResignReply:
        return self.uploads.resign(site, keys)

    def worker_exit(self, site: str, error: str) -> None:
        reason = could_not_start(error)
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

    # long polls ---------------------------------------------------------------------------
    def _answer(self, site: str, verdict: task_pb2.TaskResultReply | None,
                ) -> task_pb2.TaskAssignment | Encoded | None:
        """The site's assignment or END_RUN now, None when it has nothing to do yet."""
        assignment = self.tasks.next_task(site)
        if assignment.kind == "task":
            assert assignment.client_task is not None and assignment.data is not None
            return self._assignment(assignment.client_task, assignment.data,
                                    assignment.receivers, verdict)
        if assignment.kind == "end_run":
            with self._lock:
                self._ended.add(site)
            return _A(kind=_A.KIND_END_RUN, result=verdict)
        return None

    def _park(self, site: str, poll: _Poll, *, again: bool = False) -> None:
        """Park `poll` as the site's; `again` (one taken out to be answered and still waiting)
        never displaces a poll the site sent meanwhile: it is the one answered TRY_AGAIN."""
        with self._lock:
            if self._closed.is_set() or (again and site in self._polls):
                replaced: _Poll | None = poll
            else:
                replaced = self._polls.get(site)
                self._polls[site] = poll
                if self._dispatcher is None:
                    self._dispatcher = threading.Thread(target=self._dispatch, daemon=True,
                                                        name=f"task-dispatcher-{self.ctx.job_id}")
                    self._dispatcher.start()
        if replaced is not None:  # the site asked again: its earlier request was given up on
            replaced.pending.complete(_A(kind=_A.KIND_TRY_AGAIN, result=replaced.verdict))

    def _serve(self, site: str) -> None:
        """Answer the site's parked poll if it has something to do, is past its deadline or
        the job is aborting; else leave it parked."""
        with self._lock:
            poll = self._polls.pop(site, None)
        if poll is None:
            return
        reply: Message | Encoded | None
        try:
            reply = self._answer(site, poll.verdict)
        except FedhiveError as err:  # e.g. the store refused a presign: the site's call fails
            reply = error_message(err)
        except Exception as err:  # transient: the manager sends the same assignment again
            self.ctx.log.warning("task_server.assignment_failed", site=site, error=repr(err))
            reply = None
        if reply is None:
            if self._clock() < poll.deadline and not self.ctx.abort.is_set():
                self._park(site, poll, again=True)
                if self.tasks.changed_for([site]):  # one while it was out: look again
                    self._wake.set()
                return
            reply = _A(kind=_A.KIND_TRY_AGAIN, result=poll.verdict)
        poll.pending.complete(reply)

    def _noted(self, site: str | None) -> None:
        """The task manager's change listener (under its lock: only a flag is set). A change
        for one site wakes the dispatcher only when that site has a poll parked: a broadcast's
        results, each one site's change, wake no thread (the poll parked after it looks at
        changes itself)."""
        if site is None or site in self._polls:
            self._wake.set()

    def _dispatch(self) -> None:
        """Answer the parked polls that a change of the task manager concerns as it comes;
        every WAIT_SLICE_S also those past their deadline, and all of them while the job
        aborts or a standing task's turns open by the clock."""
        sweep_at = self._clock() + WAIT_SLICE_S
        while not self._closed.is_set():
            self._wake.wait(max(0.0, sweep_at - self._clock()))
            self._wake.clear()  # before looking: a change from now on sets it again
            now = self._clock()
            with self._lock:
                parked = list(self._polls.items())
            due = set(self.tasks.changed_for(site for site, _ in parked))
            if now >= sweep_at:
                sweep_at = now + WAIT_SLICE_S
                every = self.ctx.abort.is_set() or self.tasks.turns_open_by_clock()
                due.update(site for site, poll in parked if every or poll.deadline <= now)
            for site in due:
                try:
                    self._serve(site)
                except Exception as err:  # never lose the dispatcher: its site asks again
                    self.ctx.log.error("task_server.dispatch_failed", site=site,
                                       error=repr(err), exc_info=True)

    # internals ----------------------------------------------------------------------------
    def _gone(self, site: str, reason: str) -> None:
        self.ctx.site_gone(site, reason)
        self.tasks.site_gone(site)
        with self._lock:
            self._ended.add(site)

    def _assignment(self, client_task: ClientTask, data: Dxo, receivers: int,
                    verdict: task_pb2.TaskResultReply | None) -> Encoded:
        task = client_task.task
        round_ = data.meta.get(MetaKey.CURRENT_ROUND)
        packed = self._task_data.encoded(task, data, receivers)
        self.uploads.assigned(client_task.id, client_task.site, task.name,
                              int(round_) if isinstance(round_, int | float) else None,
                              packed.keys)
        own = _A(kind=_A.KIND_TASK, task_id=client_task.id, task_name=task.name,
                 props=dict_to_struct(task.props), timeout_ms=int(task.timeout * 1000),
                 result=verdict)
        return replace(packed.encoded, head=own.SerializeToString())


def could_not_start(error: str) -> str:
    """Why a site whose client job could not start (`WorkerExit`) left the job."""
    return f"client job could not start: {' '.join(error.split())}"


@dataclass(frozen=True)
class _Poll:
    """A site's long poll, parked until it has something to do or `deadline` passes."""

    pending: Pending
    deadline: float  # on the server's clock
    verdict: task_pb2.TaskResultReply | None  # on the result whose reply this poll is
