"""The task manager's scheduling rules (FLARE's wf_comm_server and its bcast manager), driven
with a fake clock: validation of tasks and their arguments, broadcast (targets, minimum
responses, wait time, gone sites), timeouts, cancelling and waiting."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fedhive.errors import InvalidArgument, PermissionDenied
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode, Task

from .support import SITES, Clock, answer, done_log, make_task, nothing_for, take

# -- validation (FLARE's messages) ----------------------------------------------------------

def test_a_task_object_is_scheduled_only_once(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task)
    with pytest.raises(InvalidArgument) as err:
        tm.send(task, ["a"])
    assert str(err.value) == "Task was already used. Please create a new task object."


def test_broadcast_min_responses_must_not_exceed_explicit_targets(tm: TaskManager) -> None:
    with pytest.raises(InvalidArgument) as err:
        tm.broadcast(make_task(), targets=["a", "b"], min_responses=3)
    assert str(err.value) == "min_responses (3) must be less than length of targets (2)."


@pytest.mark.parametrize(("call", "message"), [
    (lambda tm: tm.broadcast(make_task(), min_responses=-1), "min_responses must >= 0."),
    (lambda tm: tm.broadcast(make_task(), wait_time_after_min_received=-1),
     "wait_time_after_min_received must >= 0."),
    (lambda tm: tm.send(make_task(), []), "Targets must be provided for send."),
    (lambda tm: tm.send(make_task(timeout=5), ["a"], task_assignment_timeout=6),
     "task_assignment_timeout (6) needs to be less than or equal to task.timeout (5)."),
    (lambda tm: tm.relay(make_task(timeout=5), task_assignment_timeout=6),
     "task_assignment_timeout (6) needs to be less than or equal to task.timeout (5)."),
    (lambda tm: tm.relay(make_task(timeout=5), task_result_timeout=7),
     "task_result_timeout (7) needs to be less than or equal to task.timeout (5)."),
    (lambda tm: tm.relay(make_task(), dynamic_targets=False),
     "Need to provide targets when dynamic_targets is set to False."),
    (lambda tm: tm.send(make_task(), ["a"], send_order="random"),
     "send_order must be one of ['sequential', 'any'], got 'random'"),
    (lambda tm: tm.broadcast(make_task(), targets=["a", "mallory"]),
     "task 'train': target site 'mallory' is not a site of this job"),
])
def test_scheduling_arguments_are_validated(tm: TaskManager, call: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        call(tm)
    assert str(err.value) == message
    assert tm.standing() == []


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"timeout": -1}, "timeout"), ({"props": []}, "props"), ({"task_done_cb": 3}, "task_done_cb"),
])
def test_task_fields_are_validated(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        make_task(**kwargs)
    assert err.value.field == field
    with pytest.raises(InvalidArgument, match="data must be a Dxo"):
        Task("train", {"w": 1})  # type: ignore[arg-type]


def test_sites_outside_the_job_are_refused(tm: TaskManager) -> None:
    with pytest.raises(PermissionDenied, match="'mallory' is not a site of this job"):
        tm.next_task("mallory")
    with pytest.raises(PermissionDenied):
        tm.submit("mallory", "x", Result(ReturnCode.OK))


# -- broadcast ------------------------------------------------------------------------------

def test_broadcast_targets_default_to_live_sites_and_are_deduplicated(tm: TaskManager) -> None:
    tm.site_gone("c")
    snapshot, explicit = make_task(), make_task()
    tm.broadcast(snapshot)
    tm.broadcast(explicit, targets=["b", "a", "b"])
    assert snapshot.targets == ["a", "b"]
    assert explicit.targets == ["b", "a"]


def test_broadcast_default_min_completes_on_first_result(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    first, _ = take(tm, "a"), take(tm, "b")
    answer(tm, first)
    assert task.completion_status is CompletionStatus.OK
    assert calls == [CompletionStatus.OK]
    assert tm.standing() == []


def test_broadcast_waits_wait_time_after_min_received(tm: TaskManager, clock: Clock) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=2, wait_time_after_min_received=5)
    cts = [take(tm, site) for site in SITES]
    clock.now = 1
    answer(tm, cts[0])
    clock.now = 3
    answer(tm, cts[1])  # min met at t=3
    clock.now = 7.9
    assert tm.check() == []
    clock.now = 8
    assert tm.check() == [task]
    assert task.completion_status is CompletionStatus.OK
    late = tm.submit("c", cts[2].id, Result(ReturnCode.OK))
    assert not late.accepted
    assert late.reason == "late result: task 'train' already finished (ok)"


@pytest.mark.parametrize("options", [
    # every target answered before the wait after the minimum ran out
    {"min_responses": 1, "wait_time_after_min_received": 100},
    # more than the targets (ScatterAndGather's default min_clients): waits for all of them
    {"min_responses": 1000},
], ids=["all-answered-before-wait-time", "min-above-snapshot-size"])
def test_broadcast_ends_once_every_target_answered(tm: TaskManager,
                                                   options: dict[str, int]) -> None:
    task = make_task()
    tm.broadcast(task, **options)
    cts = [take(tm, site) for site in SITES]
    for ct in cts[:2]:
        answer(tm, ct)
    assert task.completion_status is None
    answer(tm, cts[2])
    assert task.completion_status is CompletionStatus.OK


def test_broadcast_min_zero_means_every_target(tm: TaskManager, clock: Clock) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=0)
    cts = [take(tm, site) for site in SITES]
    answer(tm, cts[0])
    answer(tm, cts[1])
    clock.now = 1000
    assert tm.check() == []
    answer(tm, cts[2])
    assert task.completion_status is CompletionStatus.OK


def test_broadcast_goes_to_each_target_once(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, targets=["a", "b"], min_responses=2)
    first = take(tm, "a")
    nothing_for(tm, "c")  # not a target
    answer(tm, first)
    nothing_for(tm, "a")  # already answered
    assert [ct.site for ct in task.client_tasks] == ["a"]


def test_every_site_gets_the_broadcast_data_of_the_first_send(tm: TaskManager) -> None:
    task = make_task()

    def before(client_task: ClientTask) -> None:
        task.data.meta["seen_by"] = client_task.site  # per-site changes are not sent (FLARE)

    task.before_task_sent_cb = before
    tm.broadcast(task, min_responses=3)
    first = tm.next_task("a")
    task.data.data["w"] = [2.0]  # the workflow changing its data after the first send
    second = tm.next_task("b")
    assert first.data is second.data
    assert first.data is not None
    assert first.data.meta == {"round": 0, "seen_by": "a"}
    assert first.data.data == {"w": [1.0]}


def test_broadcast_stops_waiting_for_gone_sites_once_min_is_met(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=2, wait_time_after_min_received=100)
    cts = [take(tm, site) for site in SITES]
    answer(tm, cts[0])
    answer(tm, cts[1])
    assert task.completion_status is None
    tm.site_gone("c")
    assert task.completion_status is CompletionStatus.OK


def test_broadcast_ends_client_dead_when_min_can_no_longer_be_met(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task, min_responses=2)
    answer(tm, take(tm, "a"))
    take(tm, "b")
    tm.site_gone("b")
    assert task.completion_status is None  # a and c can still make 2
    tm.site_gone("c")
    assert calls == [CompletionStatus.CLIENT_DEAD]


def test_a_site_that_answered_and_then_went_still_counts_once(tm: TaskManager) -> None:
    """Answered and gone: one response, and not also one of the lacking sites that went."""
    task = make_task()
    tm.broadcast(task, min_responses=2)
    answer(tm, take(tm, "a"))
    tm.site_gone("a")
    tm.site_gone("b")
    assert task.answered == {"a": 1}
    assert task.completion_status is None  # a's answer and c's can still make 2
    answer(tm, take(tm, "c"))
    assert task.completion_status is CompletionStatus.OK


def test_broadcast_with_every_target_gone_ends_client_dead(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, targets=["a", "b"], min_responses=1)
    tm.site_gone("a")
    assert task.completion_status is None
    tm.site_gone("b")
    assert task.completion_status is CompletionStatus.CLIENT_DEAD


def test_broadcast_keeps_waiting_for_live_sites_after_one_goes(tm: TaskManager,
                                                               clock: Clock) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=1, wait_time_after_min_received=10)
    take(tm, "a")
    tm.site_gone("a")
    answer(tm, take(tm, "b"))
    assert task.completion_status is None  # c is alive: the grace period runs
    clock.now = 10
    tm.check()
    assert task.completion_status is CompletionStatus.OK


def test_a_broadcast_to_nobody_ends_client_dead(tm: TaskManager) -> None:
    for site in SITES:
        tm.site_gone(site)
    task = make_task()
    tm.broadcast(task)
    tm.check()
    assert task.completion_status is CompletionStatus.CLIENT_DEAD


def test_error_results_count_as_answers(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, targets=["a"])
    answer(tm, take(tm, "a"), ReturnCode.EXECUTION_EXCEPTION)
    assert task.completion_status is CompletionStatus.OK
    result = task.client_tasks[0].result
    assert result is not None
    assert not result.ok


# -- generic timeout, cancel, wait ----------------------------------------------------------

def test_task_timeout(tm: TaskManager, clock: Clock) -> None:
    clock.now = 100
    task = make_task(timeout=10)
    calls = done_log(task)
    tm.broadcast(task)
    take(tm, "a")
    clock.now = 109.9
    assert tm.check() == []
    clock.now = 110
    assert tm.check() == [task]
    assert tm.check() == []
    assert calls == [CompletionStatus.TIMEOUT]


def test_cancel_ends_the_task_once_and_keeps_a_final_status(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    ct = take(tm, "a")
    tm.cancel(task)
    tm.cancel(task, CompletionStatus.ABORTED)
    assert calls == [CompletionStatus.CANCELLED]
    assert tm.submit("a", ct.id, Result(ReturnCode.OK)).reason == \
        "late result: task 'train' already finished (cancelled)"
    nothing_for(tm, "a")


def test_cancel_all(tm: TaskManager) -> None:
    tasks = [make_task("one"), make_task("two")]
    for task in tasks:
        tm.broadcast(task)
    tm.cancel_all(CompletionStatus.ABORTED)
    assert [task.completion_status for task in tasks] == [CompletionStatus.ABORTED] * 2
    assert tm.standing() == []


def test_wait_returns_once_the_task_completed(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, targets=["a"])
    ct = take(tm, "a")
    threading.Timer(0.05, answer, (tm, ct)).start()
    tm.wait(task, threading.Event())
    assert task.completion_status is CompletionStatus.OK


def test_wait_checks_exit_rules_without_a_monitor(clock: Clock) -> None:
    tm = TaskManager(SITES, clock=clock, check_period=0.01)
    task = make_task(timeout=5)
    tm.broadcast(task)
    threading.Timer(0.05, lambda: setattr(clock, "now", 5)).start()
    tm.wait(task)
    assert task.completion_status is CompletionStatus.TIMEOUT


def test_wait_cancels_with_aborted_when_abort_is_set(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    abort = threading.Event()
    threading.Timer(0.05, abort.set).start()
    tm.wait(task, abort)
    assert calls == [CompletionStatus.ABORTED]


def test_wait_on_an_unscheduled_task_is_an_error(tm: TaskManager) -> None:
    with pytest.raises(InvalidArgument, match="never scheduled"):
        tm.wait(make_task())


def test_wait_wakes_when_its_task_completes_not_on_each_result(clock: Clock) -> None:
    """The submitter runs the exit rules itself: a workflow waiting on a broadcast to many
    sites is not woken by each one's result (a thread switch per result), only by the end."""
    tm = TaskManager(SITES, clock=clock, check_period=30)  # no periodic wake within the test
    task = make_task()
    tm.broadcast(task, min_responses=3)
    waiter_checks: list[float] = []
    check = tm.check

    def counted() -> list[Task]:
        if threading.current_thread() is waiter:
            waiter_checks.append(clock())
        return check()

    tm.check = counted  # type: ignore[method-assign]
    waiter = threading.Thread(target=tm.wait, args=(task,))
    waiter.start()
    assigned = [take(tm, site) for site in SITES]
    answer(tm, assigned[0])
    answer(tm, assigned[1])
    waiter.join(timeout=0.3)
    assert waiter.is_alive() and len(waiter_checks) <= 1  # its first look only
    answer(tm, assigned[2])
    waiter.join(timeout=5)
    assert not waiter.is_alive() and task.completion_status is CompletionStatus.OK
