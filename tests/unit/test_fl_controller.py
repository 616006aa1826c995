"""The workflow base class against a real task manager, with threads acting as sites."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from fedhive.errors import FailedPrecondition
from fedhive.fl.controller import Controller
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode, SendOrder, Task
from fedhive.fl.workflow import WorkflowContext

SITES = ["site-1", "site-2", "site-3"]


class Site(threading.Thread):
    """Asks for work until told to end; answers each task with its name and the site's."""

    def __init__(self, tm: TaskManager, name: str) -> None:
        super().__init__(daemon=True)
        self.tm, self.site, self.ended = tm, name, False

    def run(self) -> None:
        while True:
            assignment = self.tm.next_task(self.site)
            if assignment.kind == "end_run":
                self.ended = True
                return
            if assignment.kind == "try_again":
                self.tm.wait_for_work(0.05, site=self.site)
                continue
            assert assignment.client_task is not None and assignment.data is not None
            step = assignment.data.meta.get("step", 0)
            dxo = Dxo(DataKind.METRICS, meta={"site": self.site, "step": step + 1})
            self.tm.submit(self.site, assignment.client_task.id, Result(ReturnCode.OK, dxo))


@pytest.fixture
def tm() -> TaskManager:
    return TaskManager(SITES, check_period=0.01)


@pytest.fixture
def ctx(tm: TaskManager, tmp_path: Path) -> WorkflowContext:
    return WorkflowContext(job_id="j1", sites=list(SITES), workspace=tmp_path,
                           log=structlog.get_logger(), tasks=tm)


@pytest.fixture
def sites(tm: TaskManager) -> Iterator[list[Site]]:
    threads = [Site(tm, name) for name in SITES]
    for thread in threads:
        thread.start()
    yield threads
    tm.end_run()
    for thread in threads:
        thread.join(5)
        assert thread.ended


class Flow(Controller):
    def __init__(self, body: Callable[[Flow], None]) -> None:
        self.body = body

    def control_flow(self) -> None:
        self.body(self)


def metrics_of(task: Task) -> dict[str, int]:
    out = {}
    for client_task in task.client_tasks:
        assert client_task.result is not None and client_task.result.dxo is not None
        out[client_task.site] = client_task.result.dxo.meta["step"]
    return out


def new_task(step: int = 0) -> Task:
    return Task("train", Dxo(DataKind.WEIGHTS, {}, {"step": step}))


def test_broadcast_and_wait_returns_with_every_result(ctx: WorkflowContext,
                                                      sites: list[Site]) -> None:
    task = new_task()
    Flow(lambda flow: flow.broadcast_and_wait(task, min_responses=0)).run(ctx)
    assert task.completion_status is CompletionStatus.OK
    assert metrics_of(task) == dict.fromkeys(SITES, 1)


def test_send_and_wait_goes_to_one_site(ctx: WorkflowContext, sites: list[Site]) -> None:
    task = new_task()
    Flow(lambda flow: flow.send_and_wait(task, ["site-2", "site-1"])).run(ctx)
    assert task.completion_status is CompletionStatus.OK
    assert metrics_of(task) == {"site-2": 1}


def test_relay_and_wait_passes_each_result_to_the_next_site(ctx: WorkflowContext,
                                                           sites: list[Site]) -> None:
    task = new_task()

    def forward(client_task: ClientTask) -> None:  # what the cyclic workflow does
        assert client_task.result is not None and client_task.result.dxo is not None
        task.data = Dxo(DataKind.WEIGHTS, {}, {"step": client_task.result.dxo.meta["step"]})

    task.result_received_cb = forward
    Flow(lambda flow: flow.relay_and_wait(task, SITES, send_order=SendOrder.SEQUENTIAL,
                                          dynamic_targets=False)).run(ctx)
    assert task.completion_status is CompletionStatus.OK
    assert metrics_of(task) == {"site-1": 1, "site-2": 2, "site-3": 3}


def test_abort_makes_the_wait_return_aborted(ctx: WorkflowContext) -> None:
    task = new_task()
    threading.Timer(0.05, ctx.abort.set).start()
    flow = Flow(lambda flow: flow.broadcast_and_wait(task))
    flow.run(ctx)  # no site ever answers
    assert task.completion_status is CompletionStatus.ABORTED
    assert flow.aborted


def test_run_cancels_only_the_tasks_this_workflow_left_standing(ctx: WorkflowContext,
                                                               tm: TaskManager) -> None:
    left, done, foreign = new_task(), new_task(), new_task()
    tm.broadcast(foreign)

    def body(flow: Controller) -> None:
        flow.broadcast(done, targets=["site-1"])
        flow.cancel_task(done, CompletionStatus.ABORTED)
        flow.broadcast(left)

    Flow(body).run(ctx)
    assert left.completion_status is CompletionStatus.CANCELLED
    assert done.completion_status is CompletionStatus.ABORTED
    assert tm.standing() == [foreign]


def test_run_cancels_what_is_left_when_the_flow_raises(ctx: WorkflowContext) -> None:
    task = new_task()

    def body(flow: Controller) -> None:
        flow.broadcast(task)
        raise RuntimeError("aggregation failed")

    with pytest.raises(RuntimeError, match="aggregation failed"):
        Flow(body).run(ctx)
    assert task.completion_status is CompletionStatus.CANCELLED


def test_cancel_all_tasks_and_active_sites(ctx: WorkflowContext, tm: TaskManager) -> None:
    tasks = [new_task(), new_task()]

    def body(flow: Controller) -> None:
        for task in tasks:
            flow.broadcast(task)
        tm.site_gone("site-2")
        assert flow.active_sites() == ["site-1", "site-3"]
        flow.cancel_all_tasks(CompletionStatus.ABORTED)

    Flow(body).run(ctx)
    assert [task.completion_status for task in tasks] == [CompletionStatus.ABORTED] * 2


def test_a_workflow_needs_the_task_manager_of_its_context(tmp_path: Path) -> None:
    flow = Flow(lambda flow: flow.broadcast(new_task()))
    with pytest.raises(FailedPrecondition, match="has no task manager"):
        flow.run(WorkflowContext(job_id="j1", sites=SITES, workspace=tmp_path,
                                 log=structlog.get_logger()))


def test_control_flow_must_be_defined(ctx: WorkflowContext) -> None:
    controller = Controller()
    controller.prepare(ctx)  # the default prepare does nothing
    with pytest.raises(NotImplementedError, match="must define control_flow"):
        controller.run(ctx)
