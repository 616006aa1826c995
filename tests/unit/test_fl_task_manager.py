"""The task manager's rules (FLARE's wf_comm_server and its bcast/send/relay managers), driven
with a fake clock: validation, which site gets which task when, when a task completes and how,
results that come late or from the wrong site, callbacks, gone sites and end of run."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fedhive.errors import InvalidArgument, PermissionDenied
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode, SendOrder, Task

SITES = ("a", "b", "c")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tm(clock: Clock) -> TaskManager:
    return TaskManager(SITES, clock=clock)


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


def test_broadcast_ends_when_all_answered_before_wait_time(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=1, wait_time_after_min_received=100)
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


def test_min_responses_above_the_snapshot_size_waits_for_all(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, min_responses=1000)  # ScatterAndGather's default min_clients
    cts = [take(tm, site) for site in SITES]
    for ct in cts[:2]:
        answer(tm, ct)
    assert task.completion_status is None
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


# -- send -----------------------------------------------------------------------------------

def test_send_sequential_without_assignment_timeout_waits_for_the_first(tm: TaskManager,
                                                                         clock: Clock) -> None:
    task = make_task()
    tm.send(task, ["a", "b"])
    tm.broadcast(make_task("other"), targets=["b"])
    clock.now = 1000
    nothing_for(tm, "b")  # BLOCK: not even the other task, b must stay free for its turn
    ct = take(tm, "a")
    assert take(tm, "b").task.name == "other"  # the send task is taken: no longer blocks b
    answer(tm, ct)
    assert task.completion_status is CompletionStatus.OK


def test_send_sequential_assignment_timeout_opens_the_next_target(tm: TaskManager,
                                                                   clock: Clock) -> None:
    task = make_task()
    tm.send(task, ["a", "b", "c"], task_assignment_timeout=10)
    clock.now = 9.9
    nothing_for(tm, "b")
    clock.now = 10
    nothing_for(tm, "c")
    ct = take(tm, "b")
    nothing_for(tm, "a")  # only one site ever gets a sent task
    answer(tm, ct)
    assert task.completion_status is CompletionStatus.OK
    assert [c.site for c in task.client_tasks] == ["b"]


def test_send_any_goes_to_the_first_target_asking(tm: TaskManager) -> None:
    task = make_task()
    tm.send(task, ["a", "b", "c"], send_order=SendOrder.ANY)
    ct = take(tm, "c")
    nothing_for(tm, "a")
    answer(tm, ct)
    assert task.completion_status is CompletionStatus.OK


def test_send_skips_a_gone_target(tm: TaskManager) -> None:
    task = make_task()
    tm.send(task, ["a", "b"])
    tm.site_gone("a")
    answer(tm, take(tm, "b"))
    assert task.completion_status is CompletionStatus.OK


def test_send_whose_holder_is_gone_ends_client_dead(tm: TaskManager) -> None:
    task = make_task()
    tm.send(task, ["a", "b"])
    take(tm, "a")
    tm.site_gone("a")
    assert task.completion_status is CompletionStatus.CLIENT_DEAD


def test_send_to_gone_targets_only_ends_client_dead(tm: TaskManager) -> None:
    tm.site_gone("a")
    task = make_task()
    tm.send(task, ["a"])
    tm.check()
    assert task.completion_status is CompletionStatus.CLIENT_DEAD


# -- relay, sequential ----------------------------------------------------------------------

def test_relay_sequential_goes_through_targets_in_order(tm: TaskManager) -> None:
    order: list[str] = []
    task = make_task(result_received_cb=lambda ct: order.append(ct.site))
    calls = done_log(task)
    tm.relay(task, ["a", "b", "c"], dynamic_targets=False)
    nothing_for(tm, "b")  # not b's turn yet
    first = take(tm, "a")
    nothing_for(tm, "b")  # a is working on it
    answer(tm, first)
    second = take(tm, "b")
    nothing_for(tm, "a")  # a had its turn
    answer(tm, second)
    answer(tm, take(tm, "c"))
    assert order == ["a", "b", "c"]
    assert calls == [CompletionStatus.OK]


def test_relay_turn_passes_when_a_site_never_takes_it(tm: TaskManager, clock: Clock) -> None:
    task = make_task()
    tm.relay(task, ["a", "b", "c"], task_assignment_timeout=10, dynamic_targets=False)
    clock.now = 9.9
    nothing_for(tm, "b")
    clock.now = 10
    answer(tm, take(tm, "b"))
    nothing_for(tm, "a")  # a's turn has passed
    clock.now = 11
    answer(tm, take(tm, "c"))
    assert task.completion_status is CompletionStatus.OK
    assert [ct.site for ct in task.client_tasks] == ["b", "c"]


def test_relay_without_takers_times_out_when_turns_run_out(tm: TaskManager,
                                                           clock: Clock) -> None:
    task = make_task()
    tm.relay(task, ["a", "b", "c"], task_assignment_timeout=10, dynamic_targets=False)
    clock.now = 39.9  # as FLARE: the window may grow to one past the end of the list
    assert tm.check() == []
    clock.now = 40
    tm.check()
    assert task.completion_status is CompletionStatus.TIMEOUT


def test_relay_result_timeout_moves_on_and_rejects_the_late_result(tm: TaskManager,
                                                                    clock: Clock) -> None:
    task = make_task()
    tm.relay(task, ["a", "b"], task_result_timeout=5, dynamic_targets=False)
    slow = take(tm, "a")
    clock.now = 5
    nothing_for(tm, "b")
    clock.now = 5.1
    second = take(tm, "b")
    late = tm.submit("a", slow.id, Result(ReturnCode.OK))
    assert not late.accepted
    assert late.reason == "late result: task 'train' has moved on to another site"
    nothing_for(tm, "a")  # not resent: the relay no longer waits for it
    answer(tm, second)
    assert task.completion_status is CompletionStatus.OK


def test_relay_ends_timeout_when_the_last_site_never_answers(tm: TaskManager,
                                                             clock: Clock) -> None:
    task = make_task()
    tm.relay(task, ["a", "b"], task_result_timeout=5, dynamic_targets=False)
    answer(tm, take(tm, "a"))
    take(tm, "b")
    clock.now = 5.1
    tm.check()
    assert task.completion_status is CompletionStatus.TIMEOUT


def test_relay_dynamic_targets_add_sites_that_ask(tm: TaskManager) -> None:
    task = make_task()
    tm.relay(task, ["a"])
    first = take(tm, "a")
    nothing_for(tm, "c")  # joins the targets, waits for its turn
    assert task.targets == ["a", "c"]
    answer(tm, first)
    answer(tm, take(tm, "c"))
    assert task.completion_status is CompletionStatus.OK


def test_relay_without_dynamic_targets_ignores_other_sites(tm: TaskManager) -> None:
    task = make_task()
    other = make_task("other")
    tm.relay(task, ["a"], dynamic_targets=False)
    tm.broadcast(other, targets=["c"])
    take(tm, "a")
    assert take(tm, "c").task is other
    assert task.targets == ["a"]


def test_relay_gives_a_site_each_turn_it_appears_in(tm: TaskManager) -> None:
    order: list[str] = []
    task = make_task(result_received_cb=lambda ct: order.append(ct.site))
    tm.relay(task, ["a", "b", "a"], dynamic_targets=False)
    for site in ("a", "b", "a"):
        answer(tm, take(tm, site))
    assert order == ["a", "b", "a"]
    assert task.completion_status is CompletionStatus.OK
    assert task.last_client_task_map["a"] is task.client_tasks[2]


def test_relay_skips_a_gone_site(tm: TaskManager) -> None:
    task = make_task()
    tm.relay(task, ["a", "b", "c"], dynamic_targets=False)
    holder = take(tm, "a")
    tm.site_gone("a")
    second = take(tm, "b")  # at once: a is not waited for
    assert not tm.submit("a", holder.id, Result(ReturnCode.OK)).accepted
    answer(tm, second)
    tm.site_gone("c")
    assert task.completion_status is CompletionStatus.OK  # the last turn taken was answered


def test_relay_whose_last_holder_is_gone_ends_client_dead(tm: TaskManager) -> None:
    task = make_task()
    tm.relay(task, ["a", "b"], dynamic_targets=False)
    answer(tm, take(tm, "a"))
    take(tm, "b")
    tm.site_gone("b")
    assert task.completion_status is CompletionStatus.CLIENT_DEAD


# -- relay, any order -----------------------------------------------------------------------

def test_relay_any_serves_one_site_at_a_time_in_asking_order(tm: TaskManager) -> None:
    order: list[str] = []
    task = make_task(result_received_cb=lambda ct: order.append(ct.site))
    tm.relay(task, ["a", "b", "c"], send_order=SendOrder.ANY, dynamic_targets=False)
    first = take(tm, "c")
    nothing_for(tm, "a")  # BLOCK while c works on it
    answer(tm, first)
    nothing_for(tm, "c")  # c had its turn
    answer(tm, take(tm, "b"))
    assert task.completion_status is None
    answer(tm, take(tm, "a"))
    assert order == ["c", "b", "a"]
    assert task.completion_status is CompletionStatus.OK


def test_relay_any_result_timeout_lets_the_next_site_take_it(tm: TaskManager,
                                                             clock: Clock) -> None:
    task = make_task()
    tm.relay(task, ["a", "b"], send_order=SendOrder.ANY, task_result_timeout=5,
             dynamic_targets=False)
    slow = take(tm, "a")
    clock.now = 5.5
    answer(tm, take(tm, "b"))
    assert tm.submit("a", slow.id, Result(ReturnCode.OK)).reason == \
        "late result: task 'train' has moved on to another site"
    assert task.completion_status is None  # a still owes its turn
    answer(tm, take(tm, "a"))
    assert task.completion_status is CompletionStatus.OK
    assert [ct.site for ct in task.client_tasks] == ["a", "b", "a"]


def test_relay_any_does_not_wait_for_gone_sites(tm: TaskManager) -> None:
    task = make_task()
    tm.relay(task, ["a", "b"], send_order=SendOrder.ANY, dynamic_targets=False)
    answer(tm, take(tm, "a"))
    tm.site_gone("b")
    assert task.completion_status is CompletionStatus.OK


# -- which task a site gets -----------------------------------------------------------------

def test_tasks_are_offered_in_scheduling_order(tm: TaskManager) -> None:
    first, second = make_task("first"), make_task("second")
    tm.broadcast(first, min_responses=2)
    tm.broadcast(second)
    for site in ("a", "b"):
        assert take(tm, site).task is first
    answer(tm, first.client_tasks[0])  # a's first is answered: its next request gets second
    assert take(tm, "a").task is second
    assert take(tm, "b").task is first  # resent: b has not answered it


def test_an_unanswered_assignment_is_resent_unchanged(tm: TaskManager) -> None:
    sent: list[tuple[str, int]] = []
    task = make_task(before_task_sent_cb=lambda ct: sent.append((ct.id, ct.send_count)))
    tm.broadcast(task)
    first = take(tm, "a")
    again = take(tm, "a")
    assert again is first
    assert first.send_count == 2
    assert sent == [(first.id, 1), (first.id, 2)]  # FLARE: callbacks around every send
    assert len(task.client_tasks) == 1


# -- results --------------------------------------------------------------------------------

def test_results_that_cannot_be_accepted_are_rejected_with_reasons(tm: TaskManager) -> None:
    task = make_task(result_received_cb=lambda ct: None)
    tm.broadcast(task, min_responses=2)
    ct = take(tm, "a")
    assert tm.submit("a", "nope", Result(ReturnCode.OK)).reason == "unknown task id 'nope'"
    assert tm.submit("b", ct.id, Result(ReturnCode.OK)).reason == \
        f"task id {ct.id!r} was not assigned to site 'b'"
    answer(tm, ct)
    assert tm.submit("a", ct.id, Result(ReturnCode.OK)).reason == \
        "duplicate result: task 'train' already has this site's result"
    assert task.client_tasks[0].result is not None


def test_result_received_cb_is_called_once_per_accepted_result(tm: TaskManager) -> None:
    received: list[str] = []
    task = make_task(result_received_cb=lambda ct: received.append(ct.site))
    tm.broadcast(task, min_responses=0)
    cts = [take(tm, site) for site in SITES]
    for ct in cts:
        answer(tm, ct)
        tm.submit(ct.site, ct.id, Result(ReturnCode.OK))  # duplicates are rejected
    assert received == ["a", "b", "c"]


# -- callbacks ------------------------------------------------------------------------------

def boom(_: Any) -> None:
    raise RuntimeError("boom")


def test_a_failing_before_task_sent_cb_ends_the_task_error(tm: TaskManager) -> None:
    after: list[str] = []
    task = make_task(before_task_sent_cb=boom, after_task_sent_cb=lambda ct: after.append(ct.site))
    calls = done_log(task)
    tm.broadcast(task)
    nothing_for(tm, "a")
    assert after == ["a"]  # FLARE: always called, to let the app clean up
    assert calls == [CompletionStatus.ERROR]


def test_a_failing_result_received_cb_ends_the_task_error(tm: TaskManager) -> None:
    task = make_task(result_received_cb=boom)
    calls = done_log(task)
    tm.broadcast(task, min_responses=2)
    answer(tm, take(tm, "a"))
    assert calls == [CompletionStatus.ERROR]


def test_a_failing_task_done_cb_sets_error(tm: TaskManager) -> None:
    task = make_task(task_done_cb=boom)
    tm.broadcast(task, targets=["a"])
    answer(tm, take(tm, "a"))
    assert task.completion_status is CompletionStatus.ERROR
    assert tm.standing() == []


def test_task_done_cb_runs_once_with_concurrent_checkers(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    task_ready = threading.Barrier(4)

    def checker() -> None:
        task_ready.wait()
        for _ in range(50):
            tm.check()

    threads = [threading.Thread(target=checker) for _ in range(3)]
    for thread in threads:
        thread.start()
    task_ready.wait()
    answer(tm, take(tm, "a"))
    for thread in threads:
        thread.join()
    assert calls == [CompletionStatus.OK]


def test_callbacks_may_schedule_and_cancel_tasks(tm: TaskManager) -> None:
    follow_up = make_task("next")
    task = make_task(task_done_cb=lambda t: tm.broadcast(follow_up))
    tm.broadcast(task, targets=["a"])
    answer(tm, take(tm, "a"))
    assert tm.standing() == [follow_up]
    canceller = make_task("self-cancel", before_task_sent_cb=lambda ct: tm.cancel(ct.task))
    tm.cancel(follow_up)
    tm.broadcast(canceller)
    nothing_for(tm, "b")
    assert canceller.completion_status is CompletionStatus.CANCELLED


# -- gone sites, end of run, waiting for work -----------------------------------------------

def test_a_gone_site_is_told_to_end_and_no_longer_active(tm: TaskManager) -> None:
    tm.site_gone("b")
    assert tm.next_task("b").kind == "end_run"
    assert tm.active_sites() == ["a", "c"]


def test_end_run_cancels_standing_tasks_and_ends_every_site(tm: TaskManager) -> None:
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    ct = take(tm, "a")
    tm.end_run()
    assert calls == [CompletionStatus.CANCELLED]
    assert [tm.next_task(site).kind for site in SITES] == ["end_run"] * 3
    assert not tm.submit("a", ct.id, Result(ReturnCode.OK)).accepted


def test_wait_for_work_wakes_on_a_new_task(tm: TaskManager) -> None:
    assert tm.wait_for_work(0.01) is False
    threading.Timer(0.05, tm.broadcast, (make_task(),)).start()
    assert tm.wait_for_work(5) is True
    assert take(tm, "a").task.name == "train"


def test_wait_for_work_for_a_site_sees_changes_since_its_last_request(tm: TaskManager) -> None:
    nothing_for(tm, "a")
    tm.broadcast(make_task())  # scheduled between a's request and its wait
    assert tm.wait_for_work(0, site="a") is True
    take(tm, "a")
    assert tm.wait_for_work(0, site="a") is False


def test_a_task_scheduled_after_end_run_is_cancelled_at_once(tm: TaskManager) -> None:
    tm.end_run()
    task = make_task()
    calls = done_log(task)
    tm.broadcast(task)
    assert calls == [CompletionStatus.CANCELLED]
    tm.wait(task)  # returns: nothing is left to wait for


def test_site_gone_ignores_repeats_and_strangers(tm: TaskManager, clock: Clock) -> None:
    tm.site_gone("a")
    clock.now = 5
    tm.site_gone("a")
    tm.site_gone("mallory")
    assert tm.active_sites() == ["b", "c"]


def test_a_finished_tasks_assignment_is_not_another_sites_to_answer(tm: TaskManager) -> None:
    task = make_task()
    tm.broadcast(task, targets=["a"])
    ct = take(tm, "a")
    tm.cancel(task)
    assert tm.submit("b", ct.id, Result(ReturnCode.OK)).reason == \
        f"task id {ct.id!r} was not assigned to site 'b'"


def test_a_result_being_processed_is_not_resent(tm: TaskManager) -> None:
    in_callback, release = threading.Event(), threading.Event()

    def slow(_: ClientTask) -> None:
        in_callback.set()
        release.wait(5)

    task = make_task(result_received_cb=slow)
    tm.broadcast(task, min_responses=2)
    ct = take(tm, "a")
    submitter = threading.Thread(target=answer, args=(tm, ct))
    submitter.start()
    assert in_callback.wait(5)
    nothing_for(tm, "a")  # its result is in: no resend while the callback runs
    release.set()
    submitter.join(5)
    assert ct.result_received_time is not None


def test_a_task_cancelled_from_its_callback_completes_after_the_callback(tm: TaskManager) -> None:
    events: list[str] = []

    def on_result(client_task: ClientTask) -> None:
        events.append("result")
        tm.cancel(client_task.task, CompletionStatus.ERROR)
        events.append("result returns")

    task = make_task(result_received_cb=on_result, task_done_cb=lambda t: events.append("done"))
    tm.broadcast(task, min_responses=3)
    answer(tm, take(tm, "a"))
    assert events == ["result", "result returns", "done"]
    assert task.completion_status is CompletionStatus.ERROR
