"""The server job's answers to operation callers (operation.proto), beside the task transport.

The gateway forwards `OperationRequest` and `ExportRequest` (as the services' broker user:
the task server takes them from no one else) for an admin it authorised to manage the job.

* `OperationRequest`: queued in the job's inbox (`ctx.operations`, an `OperationController`'s;
  a job without one is not operation-driven and says so), then answered once the operation is
  done or after `wait_ms`: PENDING, DONE with the result (its refs presigned for reading, except
  an upper tier's, which keep their own URLs), or FAILED with why.
* `ExportRequest`: the non-inline tensors of a finished operation's result, copied from this
  job's store (or the files an `export` operation's result was kept in) to presigned targets
  an upper tier granted (its hub site relays them): single PUTs (write-once when so signed) or
  multipart parts, whose ETags are returned for the grantor to complete. Only tensors of that
  result can be exported, only to http(s) URLs that are not link-local (no metadata service).
  `EXPORT_WORKERS` tensors are sent at a time: a kept one straight from its file (mapped), one
  in the store read into memory first, so memory stays at about that many tensors.
"""

from __future__ import annotations

import contextlib
import ipaddress
import mmap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from fedhive.blobs import (
    WRITE_ONCE_HEADERS,
    BlobStore,
    MultipartGrant,
    PresignedUploader,
    PresignedUrl,
    TensorCodec,
    TensorRef,
)
from fedhive.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from fedhive.fl.dxo import DataKind, Dxo, dxo_from_proto, dxo_to_proto
from fedhive.fl.model_store import kept_file
from fedhive.fl.operations import Call
from fedhive.fl.workflow import WorkflowContext
from fedhive.jobs.limits import MAX_JOB_ID
from fedhive.proto.v1 import operation_pb2
from fedhive.structs import dict_to_struct, struct_to_dict

_R = operation_pb2.OperationReply
MAX_EXPORT = 100_000  # targets in one export request
EXPORT_WORKERS = 2


class OperationDesk:
    def __init__(self, ctx: WorkflowContext, store: BlobStore, codec: TensorCodec, *,
                 url_ttl_s: int, max_wait_s: float) -> None:
        self.ctx = ctx
        self._store = store
        self._codec = codec
        self._url_ttl_s = url_ttl_s
        self._max_wait_s = max_wait_s
        self._uploader: PresignedUploader | None = None

    def operate(self, message: operation_pb2.OperationRequest) -> operation_pb2.OperationReply:
        inbox = self.ctx.operations
        if inbox is None and not self.ctx.prepared.is_set():
            raise Unavailable(f"job {self.ctx.job_id}: its workflows are starting; try again",
                              field="job_id")
        if inbox is None:
            raise FailedPrecondition(f"job {self.ctx.job_id} is not operation-driven: its "
                                     "server app runs no OperationController", field="job_id")
        op_id = _text(message.op_id, "op_id")
        task_name = _text(message.task_name or message.method, "task_name")
        data = dxo_from_proto(message.data) if message.HasField("data") \
            else Dxo(DataKind.WEIGHTS)
        call = inbox.submit(Call(op_id, task_name, message.method,
                                 struct_to_dict(message.args), data, export=message.export))
        call.done.wait(max(0.0, min(message.wait_ms / 1000, self._max_wait_s)))
        return self._reply(call)

    def _reply(self, call: Call) -> operation_pb2.OperationReply:
        if call.pending:
            return _R(state=_R.STATE_PENDING)
        contributions = dict_to_struct(call.contributions)
        if call.error or call.result is None:
            return _R(state=_R.STATE_FAILED, error=call.error, contributions=contributions)
        reply = _R(state=_R.STATE_DONE, contributions=contributions)
        dxo_to_proto(self._inlined(call),
                     lambda arrays: self._codec.pack(arrays, self.ctx.tensor_prefix),
                     into=reply.result)
        for ref in reply.result.tensors:
            if ref.key and not self.ctx.is_foreign(ref.key) and call.kept is None:
                url = self._store.presign_get(ref.key, self._url_ttl_s)
                ref.url, ref.url_expires_at_ms = url.url, url.expires_at_ms
        return reply

    def _inlined(self, call: Call) -> Dxo:
        """The call's result with its small stored tensors inline (up to the codec's threshold
        and budget, as task data is): the caller (a hub passing them up) then needs no grants,
        copies or URLs for them; what is larger stays a ref."""
        result = call.result
        assert result is not None
        budget = self._codec.inline_budget
        data: dict[str, Any] = {}
        for name, value in result.data.items():
            if isinstance(value, TensorRef) and not value.is_inline \
                    and not self.ctx.is_foreign(value.key) \
                    and value.length <= min(self._codec.inline_threshold, budget):
                with self._body(call, value) as body:
                    value = replace(value, key="", url="", url_expires_at_ms=0, offset=0,
                                    inline_data=bytes(body))
                budget -= value.length
            data[name] = value
        return Dxo(result.data_kind, data, result.meta)

    def export(self, message: operation_pb2.ExportRequest) -> operation_pb2.ExportReply:
        inbox = self.ctx.operations
        call = inbox.get(_text(message.op_id, "op_id")) if inbox is not None else None
        if call is None:
            raise NotFound(f"job {self.ctx.job_id} has no operation {message.op_id!r} (or no "
                           "longer keeps it)", field="op_id")
        if call.pending or call.result is None:
            raise FailedPrecondition(f"operation {message.op_id!r} has no result to export "
                                     f"({call.error or 'still running'})", field="op_id")
        if len(message.targets) > MAX_EXPORT:
            raise InvalidArgument(f"{len(message.targets)} export targets (at most "
                                  f"{MAX_EXPORT})", field="targets")
        refs = {ref.name: ref for ref in call.result.refs()}
        for target in message.targets:
            for url in (target.url, *target.part_urls):
                _check_target(url)
        pairs = []
        for target in message.targets:
            ref = refs.get(target.name)
            if ref is None or ref.is_inline or self.ctx.is_foreign(ref.key):
                raise InvalidArgument(f"operation {message.op_id!r}: {target.name[:200]!r} is "
                                      "not a stored tensor of its result", field="targets")
            if not (target.url or target.part_urls):
                raise InvalidArgument(f"export target {target.name[:200]!r} has no URL",
                                      field="targets")
            pairs.append((ref, target))

        def send(pair: tuple[TensorRef, operation_pb2.ExportTarget]) -> list[str]:
            ref, target = pair
            with self._body(call, ref) as body:
                if not target.part_urls:
                    self._upload().put(target.url, ref.name, body, headers=WRITE_ONCE_HEADERS
                                       if target.write_once else None)
                    return []
                grant = MultipartGrant("", target.part_size,
                                       [PresignedUrl(url, 0) for url in target.part_urls])
                return self._upload().put_parts(grant, ref.name, body)

        reply = operation_pb2.ExportReply()
        with ThreadPoolExecutor(max_workers=EXPORT_WORKERS) as pool:
            for etags in pool.map(send, pairs):
                reply.targets.add(etags=etags)
        self.ctx.log.info("operation.exported", op_id=message.op_id,
                          tensors=len(message.targets))
        return reply

    @contextlib.contextmanager
    def _body(self, call: Call, ref: TensorRef) -> Iterator[memoryview]:
        """The bytes of a stored tensor of the call's result: its kept file mapped, or read
        from the store."""
        if call.kept is None:
            body = memoryview(bytearray(ref.length))
            self._store.read_into(ref.key, body, ref.offset)
            yield body
            return
        path = kept_file(call.kept, self.ctx.tensor_prefix, ref.key)
        if not path.is_file():  # a later operation ended: its files went
            raise NotFound(f"operation {call.op_id!r}: its result is no longer kept (a later "
                           "operation ended)", field="op_id")
        if ref.length == 0:
            yield memoryview(b"")
            return
        with path.open("rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        whole = memoryview(mapped)
        try:
            yield whole[ref.offset:ref.offset + ref.length]
        finally:
            whole.release()
            with contextlib.suppress(BufferError):  # a slice still held: unmapped when freed
                mapped.close()

    def _upload(self) -> PresignedUploader:
        if self._uploader is None:
            self._uploader = PresignedUploader()
        return self._uploader


def _check_target(url: str) -> None:
    """An export goes to an object store over http(s): never to another scheme, nor to a
    link-local address (a cloud host's metadata service) a manager of the job might name."""
    if not url:
        return
    parts = urlsplit(url)
    host = (parts.hostname or "").strip("[]")
    try:
        link_local = ipaddress.ip_address(host).is_link_local
    except ValueError:
        link_local = host in ("metadata", "metadata.google.internal")
    if parts.scheme not in ("http", "https") or not host or link_local:
        raise InvalidArgument(f"export target {url[:200]!r} is not an http(s) URL of an "
                              "object store", field="targets")


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{field} is required", field=field)
    if len(value) > MAX_JOB_ID:
        raise InvalidArgument(f"{field} is longer than {MAX_JOB_ID} characters", field=field)
    return value
