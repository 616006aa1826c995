"""The inbox of an operation-driven server job: operations callers asked for, and their ends.

The task server's handler threads `submit` (an `OperationRequest` the gateway forwarded) and
`wait` for the outcome up to the caller's budget; the job's `OperationController` takes them
one at a time (`next`) and records each end (`finish`, `fail`). An op id names one operation
for good: asking again with it answers the same operation (running, or its outcome), so a
caller that lost a reply, or a hub site that restarted, never runs a round twice. The last
`KEEP` outcomes are remembered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive.errors import FailedPrecondition, InvalidArgument
from fedhive.fl.dxo import Dxo

END = "end"  # the method that ends an operation-driven job
KEEP = 64


@dataclass
class Call:
    op_id: str
    task_name: str
    method: str
    args: dict[str, Any]
    data: Dxo
    export: bool = False  # the caller copies the result up (OperationRequest.export)
    kept: Path | None = None  # where the result's stored tensors are, when not in the store
    result: Dxo | None = None
    error: str = ""
    contributions: dict[str, Any] = field(default_factory=dict)
    taken_at: float | None = None  # when the controller picked it up
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def pending(self) -> bool:
        return not self.done.is_set()


class Operations:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Call] = deque()
        self._calls: OrderedDict[str, Call] = OrderedDict()
        self._closed = ""

    def submit(self, call: Call) -> Call:
        """Queue `call`, or return the one its op id named before (InvalidArgument when that
        was another task); FailedPrecondition once the job's operations have ended."""
        with self._cond:
            known = self._calls.get(call.op_id)
            if known is not None:
                if known.task_name != call.task_name or known.method != call.method:
                    raise InvalidArgument(
                        f"operation {call.op_id!r} was task {known.task_name!r} "
                        f"({known.method or 'configured'}), not {call.task_name!r}",
                        field="op_id")
                return known
            if self._closed:
                raise FailedPrecondition(f"the job takes no more operations: {self._closed}",
                                         field="job_id")
            self._calls[call.op_id] = call
            while len(self._calls) > KEEP:
                oldest = next(iter(self._calls.values()))
                if oldest.pending:
                    break
                self._calls.popitem(last=False)
            self._queue.append(call)
            self._cond.notify_all()
            return call

    def get(self, op_id: str) -> Call | None:
        with self._cond:
            return self._calls.get(op_id)

    def next(self, timeout: float) -> Call | None:
        """The next queued call (marked taken), or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            call = self._queue.popleft()
            call.taken_at = time.monotonic()
            return call

    def finish(self, call: Call, result: Dxo, contributions: dict[str, Any]) -> None:
        call.result, call.contributions = result, contributions
        call.done.set()

    def fail(self, call: Call, error: str, contributions: dict[str, Any] | None = None) -> None:
        call.error, call.contributions = error or "the operation failed", contributions or {}
        call.done.set()

    def close(self, reason: str) -> None:
        """No more operations: queued ones fail with `reason`, later ones are refused."""
        with self._cond:
            self._closed = reason or "the job's operations ended"
            queued, self._queue = list(self._queue), deque()
        for call in queued:
            self.fail(call, reason)
