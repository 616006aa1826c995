"""The task manager's send and relay rules (FLARE's send and relay managers), driven with a
fake clock: sequential and any order, assignment and result timeouts, dynamic targets, gone
sites."""

from __future__ import annotations

from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import CompletionStatus, Result, ReturnCode, SendOrder

from .support import Clock, answer, done_log, make_task, nothing_for, take

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


# -- what long polls must be asked again for as time passes ---------------------------------

def test_turns_open_by_the_clock_only_under_timed_sends_and_relays(tm: TaskManager) -> None:
    def standing(schedule: str, **timeouts: float) -> bool:
        task = make_task(schedule)
        if schedule == "broadcast":
            tm.broadcast(task, targets=["a", "b"])
        elif schedule == "send_any":
            tm.send(task, ["a", "b"], SendOrder.ANY, **timeouts)
        else:
            getattr(tm, schedule)(task, ["a", "b"], **timeouts)
        opens = tm.turns_open_by_clock()
        tm.cancel(task, CompletionStatus.ABORTED)
        return opens

    assert not standing("broadcast")
    assert not standing("send")  # without an assignment timeout only a result opens turns
    assert standing("send", task_assignment_timeout=5)
    assert not standing("send_any", task_assignment_timeout=5)  # any target may take it now
    assert not standing("relay")
    assert standing("relay", task_assignment_timeout=5)
    assert standing("relay", task_result_timeout=5)
    assert not tm.turns_open_by_clock()
