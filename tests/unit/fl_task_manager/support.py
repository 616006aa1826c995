"""What the task manager's tests share: three sites, a fake clock, and short ways to take,
answer and inspect tasks."""

from __future__ import annotations

from typing import Any

from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode, Task

SITES = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_task(name: str = "train", **kwargs: Any) -> Task:
    return Task(name, Dxo(DataKind.WEIGHTS, {"w": [1.0]}, {"round": 0}), **kwargs)


def take(tm: TaskManager, site: str) -> ClientTask:
    assignment = tm.next_task(site)
    assert assignment.kind == "task", f"{site} got {assignment.kind}"
    assert assignment.client_task is not None
    return assignment.client_task


def answer(tm: TaskManager, client_task: ClientTask, code: str = ReturnCode.OK) -> None:
    submission = tm.submit(client_task.site, client_task.id, Result(code))
    assert submission.accepted, submission.reason


def nothing_for(tm: TaskManager, site: str) -> None:
    assert tm.next_task(site).kind == "try_again"


def done_log(task: Task) -> list[CompletionStatus | None]:
    """Make task_done_cb record the status each time it is called."""
    calls: list[CompletionStatus | None] = []
    task.task_done_cb = lambda t: calls.append(t.completion_status)
    return calls
