"""A task's data as it goes out to its sites: encoded once per task, for all of them.

The `data` field of a `TaskAssignment` (`TaskServer` adds each site's own part beside it: an
`Encoded` reply's head): the task's arrays packed by the job's codec (inline up to its
threshold, their bytes attached after the message; stored past it), refs without a fresh URL
(the global model, a site's result forwarded to the next site) presigned, and a broadcast's
inline bytes stored once instead when their copies to all its sites would pass FAN_OUT_BUDGET.
Kept per standing task and encoded again when the workflow gives the task other data (as the
cyclic relay does between sends) or a URL in it nears its expiry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fedhive.blobs import Attachment, TensorRef
from fedhive.bus import Encoded
from fedhive.fl.dxo import Dxo, dxo_to_proto
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.proto.v1 import task_pb2

URL_MARGIN_MS = 600_000  # re-sign a cached URL that would expire within 10 minutes
# A broadcast's inline bytes times its sites, past which they are stored once instead: each
# copy passes this process's socket (~0.5 ms of its CPU per MiB) and waits in a queue of the
# broker (a 16 MiB inline model to 300 sites would be 4.8 GB there); stored, the round waits for
# one upload and the sites' downloads. A 1 MiB model on one machine (bench/RESULTS.md, scale):
# inline rounds are faster at 64 sites, stored ones as fast at 100 with 20 % less server CPU.
FAN_OUT_BUDGET = 64 * 1024 * 1024


@dataclass(frozen=True)
class Packed:
    identity: dict[str, int]  # name -> id() of each value encoded
    values: dict[str, Any]  # holds those values, so their ids stay theirs
    meta: dict[str, Any]
    refs: dict[str, TensorRef]  # the arrays' refs, as packed
    encoded: Encoded  # TaskAssignment(data=...), serialized with its arrays attached
    renew_at_ms: int  # when a URL in it comes within the margin of its expiry
    keys: frozenset[str]  # the objects it names


class TaskData:
    """The job's standing tasks' data, encoded (one per job, shared by its handler threads)."""

    def __init__(self, ctx: WorkflowContext, *, url_ttl_s: int,
                 fan_out_budget: int = FAN_OUT_BUDGET) -> None:
        assert ctx.tasks is not None and ctx.store is not None and ctx.codec is not None
        self.ctx = ctx
        self._tasks: TaskManager = ctx.tasks
        self._store = ctx.store
        self._codec = ctx.codec
        self._url_ttl_s = url_ttl_s
        self._fan_out_budget = fan_out_budget
        self._lock = threading.Lock()  # guards the two below: handler threads share them
        self._packed: dict[str, Packed] = {}  # task id -> its data, encoded
        self._packing: dict[str, threading.Lock] = {}

    def encoded(self, task: Task, data: Dxo, receivers: int) -> Packed:
        """The assignment's `data` field for `task` with this `data` (see the module): from
        the cache, or encoded now; `receivers`, how many sites get these same bytes (a
        broadcast's targets), decides whether inline bytes are stored instead. Sites asking at
        once for a new task wait for one of them to encode it."""
        identity = {name: id(value) for name, value in data.data.items()}
        standing = {t.id for t in self._tasks.standing()} | {task.id}
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
            cached = self._encode(data, identity, refs, receivers, now_ms)
            with self._lock:
                self._packed[task.id] = cached
        return cached

    def _encode(self, data: Dxo, identity: dict[str, int], refs: dict[str, TensorRef],
                receivers: int, now_ms: int) -> Packed:
        wire: dict[str, TensorRef] = {name: refs.get(name, value)
                                      for name, value in data.data.items()}
        inline = [name for name, ref in wire.items() if ref.is_inline and ref.length]
        if receivers * sum(wire[name].length for name in inline) > self._fan_out_budget:
            stored = self._codec.store([wire[name] for name in inline], self.ctx.tensor_prefix)
            wire.update(zip(inline, stored, strict=True))
        holder, attachment = task_pb2.TaskAssignment(), Attachment()
        dxo_to_proto(replace(data, data=wire), _refs_only, into=holder.data,
                     attachment=attachment)
        margin = min(URL_MARGIN_MS, self._url_ttl_s * 500)
        renew_at = now_ms + self._url_ttl_s * 1000
        for ref in holder.data.tensors:
            if not ref.key or self.ctx.is_foreign(ref.key):  # an upper tier's keeps its URL
                continue
            if ref.url_expires_at_ms - now_ms < margin:
                url = self._store.presign_get(ref.key, self._url_ttl_s)
                ref.url, ref.url_expires_at_ms = url.url, url.expires_at_ms
            renew_at = min(renew_at, ref.url_expires_at_ms - margin)
        keys = frozenset(ref.key for ref in holder.data.tensors if ref.key)
        encoded = Encoded.attaching(task_pb2.TaskAssignment, holder.SerializeToString(),
                                    attachment.parts)
        return Packed(identity, dict(data.data), dict(data.meta), refs, encoded, renew_at, keys)


def _refs_only(arrays: Mapping[str, Any]) -> list[TensorRef]:
    raise AssertionError(f"arrays left unpacked: {sorted(arrays)}")
