"""The base class of workflows (FLARE's Controller): give sites work through the task manager.

    class Hello(Controller):
        def control_flow(self) -> None:
            task = Task("hello", Dxo(DataKind.METRICS))
            self.broadcast_and_wait(task, min_responses=0)  # every site
            for client_task in task.client_tasks: ...

`run(ctx)` (what the server job calls) runs `control_flow()` and then cancels whatever this
workflow left standing. The *_and_wait variants return when the task has completed, or at once
when the job is aborted (the task then ends ABORTED): check `self.aborted` after them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedhive.errors import FailedPrecondition
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import CompletionStatus, SendOrder, Task
from fedhive.fl.workflow import WorkflowContext


class Controller:
    """Subclasses define `control_flow`; they need not call `Controller.__init__`."""

    ctx: WorkflowContext

    def prepare(self, ctx: WorkflowContext) -> None:
        """Called for every workflow before the first one runs: look up components here."""

    def run(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx
        try:
            self.control_flow()
        finally:
            self.cancel_all_tasks()

    def control_flow(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define control_flow()")

    @property
    def tasks(self) -> TaskManager:
        if getattr(self, "ctx", None) is None or self.ctx.tasks is None:
            raise FailedPrecondition(f"workflow {type(self).__name__} has no task manager: "
                                     "it runs only inside a server job (ctx.tasks)")
        return self.ctx.tasks

    @property
    def aborted(self) -> bool:
        return self.ctx.abort.is_set()

    def active_sites(self) -> list[str]:
        return self.tasks.active_sites()

    def broadcast(self, task: Task, targets: Sequence[str] | None = None, min_responses: int = 1,
                  wait_time_after_min_received: float = 0) -> None:
        self.tasks.broadcast(task, targets, min_responses, wait_time_after_min_received)
        self._remember(task)

    def broadcast_and_wait(self, task: Task, targets: Sequence[str] | None = None,
                           min_responses: int = 1, wait_time_after_min_received: float = 0) -> None:
        self.broadcast(task, targets, min_responses, wait_time_after_min_received)
        self.tasks.wait(task, self.ctx.abort)

    def send(self, task: Task, targets: Sequence[str],
             send_order: SendOrder = SendOrder.SEQUENTIAL,
             task_assignment_timeout: float = 0) -> None:
        self.tasks.send(task, targets, send_order, task_assignment_timeout)
        self._remember(task)

    def send_and_wait(self, task: Task, targets: Sequence[str],
                      send_order: SendOrder = SendOrder.SEQUENTIAL,
                      task_assignment_timeout: float = 0) -> None:
        self.send(task, targets, send_order, task_assignment_timeout)
        self.tasks.wait(task, self.ctx.abort)

    def relay(self, task: Task, targets: Sequence[str] | None = None,
              send_order: SendOrder = SendOrder.SEQUENTIAL, task_assignment_timeout: float = 0,
              task_result_timeout: float = 0, dynamic_targets: bool = True) -> None:
        self.tasks.relay(task, targets, send_order, task_assignment_timeout, task_result_timeout,
                         dynamic_targets)
        self._remember(task)

    def relay_and_wait(self, task: Task, targets: Sequence[str] | None = None,
                       send_order: SendOrder = SendOrder.SEQUENTIAL,
                       task_assignment_timeout: float = 0, task_result_timeout: float = 0,
                       dynamic_targets: bool = True) -> None:
        self.relay(task, targets, send_order, task_assignment_timeout, task_result_timeout,
                   dynamic_targets)
        self.tasks.wait(task, self.ctx.abort)

    def cancel_task(self, task: Task,
                    completion_status: CompletionStatus = CompletionStatus.CANCELLED) -> None:
        self.tasks.cancel(task, completion_status)

    def cancel_all_tasks(self,
                         completion_status: CompletionStatus = CompletionStatus.CANCELLED) -> None:
        """Cancel the tasks this workflow scheduled that are still standing (not those of other
        workflows sharing the task manager)."""
        scheduled = self._own_tasks()
        for task in scheduled:
            self.tasks.cancel(task, completion_status)
        scheduled.clear()

    def _own_tasks(self) -> list[Task]:
        """What this workflow scheduled and may have left standing (kept without needing
        subclasses to call `Controller.__init__`)."""
        own: list[Task] = self.__dict__.setdefault("_own_tasks_list", [])
        return own

    def _remember(self, task: Task) -> None:
        standing = {t.id for t in self.tasks.standing()}
        own = self._own_tasks()
        own[:] = [t for t in own if t.id in standing]
        own.append(task)
