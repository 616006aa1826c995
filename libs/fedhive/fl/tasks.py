"""The task API's data types (FLARE's controller_spec): what a workflow schedules (`Task`), what
one site was given (`ClientTask`) and what it sent back (`Result`).

A `Task` is scheduled once, through one of `TaskManager.broadcast`, `send` or `relay`; the
manager fills its runtime fields. Callbacks run on whichever thread drives the manager (a site's
request, a result, the monitor), never under the manager's lock, and one at a time per task:
`before_task_sent_cb(client_task)` / `after_task_sent_cb(client_task)` around every send
(a resend included), `result_received_cb(client_task)` once per accepted result, and
`task_done_cb(task)` once, when the task has completed. A callback that raises ends the task
with `CompletionStatus.ERROR`. Keep the send callbacks quick: in a server job one thread hands
out every waiting site's assignment (`fedhive.fl.task_server`), so a slow one delays them all.
"""

from __future__ import annotations

import enum
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import Dxo


class CompletionStatus(enum.StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"
    ERROR = "error"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    CLIENT_DEAD = "client_dead"


class SendOrder(enum.StrEnum):
    SEQUENTIAL = "sequential"  # the order of the targets list is enforced
    ANY = "any"  # whichever target asks first


class ReturnCode:
    """A result's return code; these strings travel on the wire."""

    OK = "OK"
    EXECUTION_EXCEPTION = "EXECUTION_EXCEPTION"
    TASK_UNKNOWN = "TASK_UNKNOWN"
    TASK_ABORTED = "TASK_ABORTED"
    BAD_TASK_DATA = "BAD_TASK_DATA"
    EARLY_TERMINATION = "EARLY_TERMINATION"
    EXECUTION_RESULT_ERROR = "EXECUTION_RESULT_ERROR"  # the server cannot use the result


@dataclass(eq=False)
class Result:
    return_code: str
    dxo: Dxo | None = None
    error: str = ""  # why, when return_code is not OK

    @property
    def ok(self) -> bool:
        return self.return_code == ReturnCode.OK


ClientTaskCallback = Callable[["ClientTask"], Any]
TaskDoneCallback = Callable[["Task"], Any]


@dataclass(eq=False)
class ClientTask:
    """One assignment of a task to one site; resending it keeps its id.

    It refers to its task weakly: a task lists its client tasks, and a strong reference back
    made a cycle that kept every site's result (an inline model each) alive after the round
    until the cyclic garbage collector happened to run (hundreds of MiB with many sites)."""

    site: str
    owner: InitVar[Task]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    send_count: int = 0
    sent_time: float | None = None  # the task manager's clock, at the latest send
    result_received_time: float | None = None
    result: Result | None = None
    props: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self, owner: Task) -> None:
        self._task = weakref.ref(owner)

    @property
    def task(self) -> Task:
        task = self._task()
        assert task is not None, "a client task outlived its task"
        return task


@dataclass(eq=False)
class Task:
    name: str
    data: Dxo = field(repr=False)
    props: dict[str, Any] = field(default_factory=dict)
    timeout: float = 0  # seconds after scheduling; 0 = never times out
    before_task_sent_cb: ClientTaskCallback | None = field(default=None, repr=False)
    after_task_sent_cb: ClientTaskCallback | None = field(default=None, repr=False)
    result_received_cb: ClientTaskCallback | None = field(default=None, repr=False)
    task_done_cb: TaskDoneCallback | None = field(default=None, repr=False)
    # runtime, filled by the task manager
    id: str = field(default_factory=lambda: uuid.uuid4().hex, init=False)
    targets: list[str] = field(default_factory=list, init=False)
    client_tasks: list[ClientTask] = field(default_factory=list, init=False, repr=False)
    # site -> its assignments answered: kept as results come in, so that a rule's check costs
    # nothing per site (a scan of client_tasks on every result was quadratic in the sites)
    answered: Counter[str] = field(default_factory=Counter, init=False, repr=False)
    last_client_task_map: dict[str, ClientTask] = field(default_factory=dict, init=False,
                                                        repr=False)
    completion_status: CompletionStatus | None = field(default=None, init=False)
    schedule_time: float | None = field(default=None, init=False)  # the manager's clock
    create_time: float = field(default_factory=time.time, init=False)  # wall clock

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument("task name must be a non-empty string", field="name")
        if not isinstance(self.data, Dxo):
            raise InvalidArgument(f"task {self.name!r}: data must be a Dxo, got "
                                  f"{type(self.data).__name__}", field="data")
        if not isinstance(self.props, dict):
            raise InvalidArgument(f"task {self.name!r}: props must be a dict", field="props")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) \
                or self.timeout < 0:
            raise InvalidArgument(f"task {self.name!r}: timeout must be a number >= 0, got "
                                  f"{self.timeout!r}", field="timeout")
        for name in ("before_task_sent_cb", "after_task_sent_cb", "result_received_cb",
                     "task_done_cb"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise InvalidArgument(f"task {self.name!r}: {name} must be callable", field=name)
