"""The server job's side of the task transport: what it answers on its job queue.

Messages (`Names.job_server_queue(job_id)`, see proto/fedhive/v1/task.proto):

* `GetTaskRequest` (RPC, site): a long poll. The next assignment from the task manager, waiting
  up to `wait_ms` (at most `max_wait_s`) for work to appear; `TRY_AGAIN` when none did,
  `END_RUN` once the run is over. Task data goes out as refs with presigned GET URLs: a task's
  arrays are packed once (`ctx.codec.pack`, cached per task until it is replaced or done), and
  refs without a URL (a site's result forwarded to the next site) are presigned.
* `TaskResult` (RPC, site): handed to `tasks.submit`; the reply says whether it was accepted
  and why not. With `next_wait_ms` the reply is the site's next assignment (the long poll
  above) carrying that verdict: one round trip per task instead of two.
  The DXO stays lazy (workflows materialize it with the credentialed store, which
  verifies checksums). A non-inline ref names the key of its own checksum (`fedhive.blobs.keys`)
  in one of three places only: the server's object (`{tensor prefix}blake3/<hex>`, which no
  site can write), the site's own upload (`{tensor prefix}sites/<site>/<task>/blake3/<hex>`,
  any of its tasks), or another site's upload that the server handed this site in this task's
  data (a relay: the cyclic workflow's next site sending back what it was given). So a
  result can never make the server read what another site may still write, and a failing
  object is blamed on the site its key names. Its URL is dropped (a site must not choose the
  URL other sites will read). A result whose data is malformed reaches the task manager as an
  `EXECUTION_RESULT_ERROR` result, so the workflow sees the site failed.
  A non-inline ref must also name an object that exists with the ref's length (one HEAD per
  ref): a result whose object is missing fails that site's task with a reason naming the job,
  site, round and tensor (the bytes' checksum is verified whenever the SJ reads them).
* `GrantUploadRequest` (RPC, site): upload targets for the given checksums, for a task the SJ
  assigned to that site and whose result has not come yet (else PermissionDenied). `present`
  (nothing to upload) when the server's object of that content exists, or the site's own
  earlier upload of it; otherwise the site's upload key for that task, the only kind of key a
  site is ever granted. With `sizes`, an array larger than `upload_part_size` gets a multipart
  grant (upload id, one presigned PUT per part), which the site completes with
  `CompleteUploadRequest`; smaller ones a write-once presigned PUT (`write_once`: signed with
  `If-None-Match: *`, so S3 refuses it once the key holds an object, and the site cannot
  rewrite what it uploaded while the URL lives, e.g. after the next site of a relay or a
  cross-site evaluation was handed it). Unfinished multipart uploads of a task are aborted when
  the site's result for it arrives.
* `CompleteUploadRequest` (RPC, site): complete a multipart upload this SJ granted to that
  site for that key (anything else: PermissionDenied), write-once (S3's conditional write:
  the parts' URLs die with the upload, and no second upload can replace the object); the
  object must then have the granted size.
* `ResignRequest` (RPC, site): fresh presigned GET URLs (a ref whose URL expired while a
  trainer worked), only for keys the SJ handed that site in the data of a task still awaiting
  its result, or that site's own uploads; anything else is PermissionDenied (another site's
  result is private to it, even when its key leaked).
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
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import Message

from fedhive.blobs import TensorRef, content_key
from fedhive.blobs.keys import parse_upload_key, upload_key, uploaded_by
from fedhive.bus import Bus, Delivery, Encoded, Senders, Subscription
from fedhive.errors import (
    AlreadyExists,
    BlobNotFound,
    FedhiveError,
    InvalidArgument,
    PermissionDenied,
)
from fedhive.fl.dxo import Dxo, MetaKey, dxo_from_proto, dxo_to_proto
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, Result, ReturnCode, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2, runner_pb2, task_pb2
from fedhive.structs import dict_to_struct

WAIT_SLICE_S = 0.2  # re-ask the manager this often: time alone can make a site eligible
URL_TTL_S = 3600
URL_MARGIN_MS = 600_000  # re-sign a cached URL that would expire within 10 minutes
MAX_GRANT = 10_000  # checksums per GrantUploadRequest, keys per ResignRequest
MiB = 1024 * 1024
UPLOAD_PART_SIZE = 64 * MiB  # larger arrays are uploaded multipart, in parts of this size
MAX_URL_TTL_S = 7 * 24 * 3600
_ASSIGNED_MEMORY = 10_000  # open assignments remembered (upload grants, relays, messages)
_UPLOADS_MEMORY = 100_000  # (site, checksum) -> the site's upload key, for present answers
_A = task_pb2.TaskAssignment


class TaskServer:
    ACCEPTS: tuple[type[Message], ...] = (
        task_pb2.GetTaskRequest, task_pb2.TaskResult, task_pb2.GrantUploadRequest,
        task_pb2.CompleteUploadRequest, task_pb2.ResignRequest, task_pb2.WorkerExit,
        runner_pb2.SiteGone,
    )

    def __init__(self, ctx: WorkflowContext, *, service_user: str, max_wait_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, url_ttl_s: int = URL_TTL_S,
                 upload_part_size: int = UPLOAD_PART_SIZE, check_workers: int = 8) -> None:
        assert ctx.tasks is not None and ctx.store is not None and ctx.codec is not None
        self.ctx = ctx
        self.tasks: TaskManager = ctx.tasks
        self._store = ctx.store
        self._codec = ctx.codec
        self._service_user = service_user
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._url_ttl_s = url_ttl_s
        self._part_size = upload_part_size
        self._check_workers = check_workers
        self._lock = threading.Lock()
        self._packed: dict[str, _Packed] = {}  # task id -> its data, encoded
        self._packing: dict[str, threading.Lock] = {}
        self._ended: set[str] = set()  # sites told END_RUN, or gone
        self._multipart: dict[tuple[str, str, str], _Upload] = {}  # (site, key, upload id)
        self._assigned: OrderedDict[str, _Assigned] = OrderedDict()  # client task id ->
        self._uploads: OrderedDict[tuple[str, str], str] = OrderedDict()

    # bus entry point ----------------------------------------------------------------------
    def serve(self, bus: Bus, queue: str, *, handlers: int) -> Subscription:
        """Answer `queue` (the job's task queue) with `handlers` threads, on a queue that is
        not replicated (why: `fedhive.bus.topology`), reached by the job's sites only."""
        names = self._names
        return bus.serve(
            queue, self.handle, self.ACCEPTS, prefetch=handlers, concurrency=handlers,
            replicated=False,
            binding_keys=[names.job_site_route(self.ctx.job_id, site) for site in self.ctx.sites],
            senders=Senders.only(self._service_user,
                                 *(names.site_user(site) for site in self.ctx.sites)))

    @property
    def _names(self) -> Names:
        assert self.ctx.names is not None
        return self.ctx.names

    def handle(self, message: Message, delivery: Delivery) -> Message | Encoded | None:
        if isinstance(message, runner_pb2.SiteGone):
            self.site_gone(message, delivery.user_id)
            return None
        site = self._sender(message, delivery.user_id)
        if isinstance(message, task_pb2.GetTaskRequest):
            return self.get_task(site, message.wait_ms)
        if isinstance(message, task_pb2.TaskResult):
            verdict = self.submit(site, message)
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
                 ) -> task_pb2.TaskAssignment | Encoded:
        """The site's next assignment, waiting up to `wait_ms` for one; `verdict` (on the result
        this call answers) goes with it."""
        deadline = self._clock() + min(max(wait_ms, 0) / 1000, self._max_wait_s)
        while True:
            assignment = self.tasks.next_task(site)
            if assignment.kind == "task":
                assert assignment.client_task is not None and assignment.data is not None
                return self._assignment(assignment.client_task, assignment.data, verdict)
            if assignment.kind == "end_run":
                with self._lock:
                    self._ended.add(site)
                return _A(kind=_A.KIND_END_RUN, result=verdict)
            left = deadline - self._clock()
            if left <= 0 or self.ctx.abort.is_set():
                return _A(kind=_A.KIND_TRY_AGAIN, result=verdict)
            self.tasks.wait_for_work(min(left, WAIT_SLICE_S), site)

    def submit(self, site: str, message: task_pb2.TaskResult) -> task_pb2.TaskResultReply:
        problem = ""
        dxo: Dxo | None = None
        try:
            if not message.return_code:
                raise InvalidArgument("the result has no return_code", field="return_code")
            if message.HasField("data"):
                dxo = self._checked(dxo_from_proto(message.data), site, message.task_id)
                self._check_objects(dxo)
        except FedhiveError as err:
            problem = f"result data rejected: {self._where(site, message.task_id)}: {err}"
        finally:
            self._abort_uploads(site, message.task_id)
            self._close(site, message.task_id)
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
        """Where to put each array: `present`, or at the site's upload key for `task_id` a
        presigned PUT or (an array above the part size, when `sizes` are given) a multipart
        grant."""
        self._open(site, task_id)
        if len(checksums) > MAX_GRANT:
            raise InvalidArgument(f"{len(checksums)} checksums in one grant request (at most "
                                  f"{MAX_GRANT})", field="checksums")
        if sizes and len(sizes) != len(checksums):
            raise InvalidArgument(f"{len(sizes)} sizes for {len(checksums)} checksums",
                                  field="sizes")
        grant = task_pb2.UploadGrant()
        multipart = 0
        for index, checksum in enumerate(checksums):
            size = sizes[index] if sizes else 0
            if size < 0:
                raise InvalidArgument(f"size {size} of {checksum[:24]}... is negative",
                                      field="sizes")
            present = self._present(site, checksum, size if sizes else None)
            key = present or upload_key(self.ctx.tensor_prefix, site, task_id, checksum)
            target = grant.targets.add(checksum=checksum, key=key, present=bool(present))
            self._remember(site, checksum, key)
            if present:
                continue
            if size > self._part_size:
                multipart += 1
                parts = self._store.presign_multipart(key, size, self._part_size,
                                                      _upload_ttl(size))
                target.upload_id, target.part_size = parts.upload_id, parts.part_size
                target.part_urls.extend(url.url for url in parts.urls)
                target.url_expires_at_ms = min(url.expires_at_ms for url in parts.urls)
                with self._lock:
                    self._multipart[(site, key, parts.upload_id)] = _Upload(task_id, size)
            else:
                url = self._store.presign_put(key, _upload_ttl(size), write_once=True)
                target.url, target.url_expires_at_ms = url.url, url.expires_at_ms
                target.write_once = True
        self.ctx.log.debug("task_server.upload_granted", site=site, objects=len(checksums),
                           multipart=multipart)
        return grant

    def complete_upload(self, site: str, message: task_pb2.CompleteUploadRequest,
                        ) -> common_pb2.Ack:
        ident = (site, message.key, message.upload_id)
        with self._lock:
            upload = self._multipart.pop(ident, None)
        if upload is None:
            raise PermissionDenied(f"job {self.ctx.job_id}: no multipart upload "
                                   f"{message.upload_id[:40]!r} of {message.key[:200]!r} was "
                                   f"granted to site {site!r}", field="upload_id")
        try:
            self._store.complete_multipart(message.key, message.upload_id, list(message.etags),
                                           write_once=True)
        except AlreadyExists:  # the site wrote its own key before: the size check judges it
            self._store.abort_multipart(message.key, message.upload_id)
        except FedhiveError:
            self._store.abort_multipart(message.key, message.upload_id)
            raise
        stored = self._store.size(message.key)
        if stored != upload.size:
            self._store.delete(message.key)
            raise InvalidArgument(f"job {self.ctx.job_id} site {site}: upload of "
                                  f"{message.key[:200]} holds {stored} bytes, {upload.size} "
                                  "were granted", field="etags")
        self.ctx.log.debug("task_server.upload_completed", site=site, key=message.key)
        return common_pb2.Ack()

    def resign(self, site: str, keys: list[str]) -> task_pb2.ResignReply:
        if len(keys) > MAX_GRANT:
            raise InvalidArgument(f"{len(keys)} keys in one resign request (at most "
                                  f"{MAX_GRANT})", field="keys")
        prefix = self.ctx.tensor_prefix
        with self._lock:
            handed = [assigned.keys for assigned in self._assigned.values()
                      if assigned.site == site]
        reply = task_pb2.ResignReply()
        for key in keys:
            upload = parse_upload_key(prefix, key)
            if not ((upload is not None and upload.site == site)
                    or any(key in given for given in handed)):
                self.ctx.log.warning("task_server.resign_refused", site=site, key=key[:200])
                raise PermissionDenied(f"job {self.ctx.job_id}: key {key[:200]!r} is neither in "
                                       f"the data of an open task of site {site!r} nor its "
                                       "upload: no URL", field="keys")
            url = self._store.presign_get(key, self._url_ttl_s)
            reply.urls.add(key=key, url=url.url, url_expires_at_ms=url.expires_at_ms)
        self.ctx.log.debug("task_server.resigned", site=site, objects=len(keys))
        return reply

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

    def _stored(self, key: str, size: int | None) -> bool:
        """The object is there (with `size` bytes, when known): nothing to upload. One of the
        wrong size is damaged: not counted."""
        try:
            stored = self._store.size(key)
        except BlobNotFound:
            return False
        if size is not None and stored != size:
            self.ctx.log.warning("task_server.damaged_object", key=key, size=stored,
                                 expected=size)
            return False
        return True

    def _present(self, site: str, checksum: str, size: int | None) -> str:
        """The key of an object with this content that `site`'s result may name, '' for none:
        the server's own (frozen layers, the global model sent back) or the site's own earlier
        upload. Never another site's: that site could still write it."""
        server = content_key(self.ctx.tensor_prefix, checksum)
        if self._stored(server, size):
            return server
        with self._lock:
            own = self._uploads.get((site, checksum), "")
        return own if own and self._stored(own, size) else ""

    def _remember(self, site: str, checksum: str, key: str) -> None:
        """`site` uploads (or has) `checksum` at `key`: its later grants may answer present."""
        if parse_upload_key(self.ctx.tensor_prefix, key) is None:
            return  # the server's object: found by its name
        with self._lock:
            self._uploads[(site, checksum)] = key
            self._uploads.move_to_end((site, checksum))
            while len(self._uploads) > _UPLOADS_MEMORY:
                self._uploads.popitem(last=False)

    def _open(self, site: str, task_id: str) -> None:
        """Upload grants are for a task assigned to `site` whose result is not in yet."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        if assigned is None or assigned.site != site:
            raise PermissionDenied(f"job {self.ctx.job_id}: task {task_id[:80]!r} is not a "
                                   f"task of site {site!r} awaiting its result: no upload "
                                   "grant", field="task_id")

    def _close(self, site: str, task_id: str) -> None:
        """`site`'s result for `task_id` came: no more grants, relays or messages for it."""
        with self._lock:
            assigned = self._assigned.get(task_id)
            if assigned is not None and assigned.site == site:
                del self._assigned[task_id]

    def _where(self, site: str, task_id: str) -> str:
        """"job J site S task T round R" for messages about a site's result."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        where = f"job {self.ctx.job_id} site {site}"
        if assigned is not None and assigned.site == site:
            where += f" task {assigned.name!r}"
            if assigned.round is not None:
                where += f" round {assigned.round}"
        return where

    def _check_objects(self, dxo: Dxo) -> None:
        """Every uploaded ref names an object that exists with the ref's length."""
        refs = [ref for ref in dxo.refs() if not ref.is_inline]
        if not refs:
            return

        def check(ref: TensorRef) -> str:
            where = f"tensor {ref.name!r}: object {ref.key}{uploaded_by(ref.key)}"
            try:
                size = self._store.size(ref.key)
            except BlobNotFound:
                return f"{where} is missing"
            if size != ref.length:
                return f"{where} holds {size} bytes, the ref says {ref.length}"
            return ""

        with ThreadPoolExecutor(max_workers=min(self._check_workers, len(refs))) as pool:
            problems = [problem for problem in pool.map(check, refs) if problem]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise InvalidArgument(problems[0] + more, field="data")

    def _abort_uploads(self, site: str, task_id: str) -> None:
        """Multipart uploads granted for this task and never completed: dropped."""
        with self._lock:
            stale = [ident for ident, upload in self._multipart.items()
                     if ident[0] == site and upload.task_id == task_id]
            for ident in stale:
                del self._multipart[ident]
        for _, key, upload_id in stale:
            try:
                self._store.abort_multipart(key, upload_id)
            except FedhiveError as err:
                self.ctx.log.warning("task_server.abort_upload_failed", key=key, error=str(err))

    def _checked(self, dxo: Dxo, site: str, task_id: str) -> Dxo:
        """Refs `site` may send for `task_id` (see the module doc), URL dropped."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        handed = assigned.keys if assigned is not None and assigned.site == site else frozenset()
        prefix = self.ctx.tensor_prefix
        for name, ref in list(dxo.data.items()):
            if not isinstance(ref, TensorRef) or ref.is_inline:
                continue
            upload = parse_upload_key(prefix, ref.key)
            if ref.offset or not (ref.key == content_key(prefix, ref.checksum) or (
                    upload is not None and upload.checksum == ref.checksum
                    and (upload.site == site or ref.key in handed))):
                raise InvalidArgument(f"tensor {name!r}: key {ref.key[:200]!r} is not the "
                                      "server's object of its checksum, nor the site's own "
                                      "upload of it, nor one its task handed it", field=name)
            dxo.data[name] = replace(ref, url="", url_expires_at_ms=0)
        return dxo

    def _assignment(self, client_task: ClientTask, data: Dxo,
                    verdict: task_pb2.TaskResultReply | None) -> Encoded:
        task = client_task.task
        round_ = data.meta.get(MetaKey.CURRENT_ROUND)
        packed = self._task_data(task, data)
        with self._lock:
            self._assigned[client_task.id] = _Assigned(
                client_task.site, task.name,
                int(round_) if isinstance(round_, int | float) else None, packed.keys)
            self._assigned.move_to_end(client_task.id)
            while len(self._assigned) > _ASSIGNED_MEMORY:
                self._assigned.popitem(last=False)
        own = _A(kind=_A.KIND_TASK, task_id=client_task.id, task_name=task.name,
                 props=dict_to_struct(task.props), timeout_ms=int(task.timeout * 1000),
                 result=verdict)
        return Encoded(_A, own.SerializeToString() + packed.encoded)

    def _task_data(self, task: Task, data: Dxo) -> _Packed:
        """The assignment's `data` field, encoded once per task for all its sites: its arrays
        packed, its refs without a fresh URL (the global model, a site's result forwarded to
        the next site) presigned. Encoded again when the workflow gave the task other data (as
        the cyclic relay does between sends) or a URL in it nears its expiry."""
        identity = {name: id(value) for name, value in data.data.items()}
        standing = {t.id for t in self.tasks.standing()} | {task.id}
        with self._lock:
            for task_id in [t for t in self._packed if t not in standing]:
                del self._packed[task_id]
                self._packing.pop(task_id, None)
            lock = self._packing.setdefault(task.id, threading.Lock())
        with lock:  # sites asking at once for a new broadcast: one encodes, the others wait
            with self._lock:
                cached = self._packed.get(task.id)
            now_ms = int(time.time() * 1000)
            if (cached is not None and cached.identity == identity and cached.meta == data.meta
                    and now_ms < cached.renew_at_ms):
                return cached
            arrays = {name: value for name, value in data.data.items()
                      if not isinstance(value, TensorRef)}
            same_arrays = cached is not None and all(
                cached.identity.get(name) == id(value) for name, value in arrays.items())
            if cached is not None and same_arrays:
                refs = cached.refs
            else:
                packed = self._codec.pack(arrays, self.ctx.tensor_prefix) if arrays else []
                refs = {ref.name: ref for ref in packed}
            cached = self._encode(data, identity, refs, now_ms)
            with self._lock:
                self._packed[task.id] = cached
        return cached

    def _encode(self, data: Dxo, identity: dict[str, int], refs: dict[str, TensorRef],
                now_ms: int) -> _Packed:
        holder = _A()
        dxo_to_proto(data, lambda values: [refs[name] for name in values], into=holder.data)
        margin = min(URL_MARGIN_MS, self._url_ttl_s * 500)
        renew_at = now_ms + self._url_ttl_s * 1000
        for ref in holder.data.tensors:
            if not ref.key:
                continue
            if ref.url_expires_at_ms - now_ms < margin:
                url = self._store.presign_get(ref.key, self._url_ttl_s)
                ref.url, ref.url_expires_at_ms = url.url, url.expires_at_ms
            renew_at = min(renew_at, ref.url_expires_at_ms - margin)
        keys = frozenset(ref.key for ref in holder.data.tensors if ref.key)
        return _Packed(identity, dict(data.data), dict(data.meta), refs,
                       holder.SerializeToString(), renew_at, keys)


def _upload_ttl(size: int) -> int:
    """An upload URL's lifetime: an hour, plus a second per MiB (a slow link still finishes)."""
    return min(URL_TTL_S + size // MiB, MAX_URL_TTL_S)


@dataclass(frozen=True)
class _Assigned:
    """A task assigned to a site, until its result comes."""

    site: str
    name: str
    round: int | None
    # the objects its data names: the site may read them (resign) and send back another
    # site's upload among them (a relay)
    keys: frozenset[str]


@dataclass(frozen=True)
class _Upload:
    task_id: str
    size: int


@dataclass(frozen=True)
class _Packed:
    identity: dict[str, int]  # name -> id() of each value encoded
    values: dict[str, Any]  # holds those values, so their ids stay theirs
    meta: dict[str, Any]
    refs: dict[str, TensorRef]  # the arrays' refs, as packed
    encoded: bytes  # TaskAssignment(data=...) serialized
    renew_at_ms: int  # when a URL in it comes within the margin of its expiry
    keys: frozenset[str]  # the objects it names
