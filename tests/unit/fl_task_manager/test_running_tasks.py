"""The task manager's rules for a running task (FLARE's wf_comm_server), driven with a fake
clock: which task a site gets, results that come late or from the wrong site, callbacks, gone
sites, end of run and waiting for work."""

from __future__ import annotations

import threading
from typing import Any

from fedhive.fl.task_manager import TaskManager
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode

from .support import SITES, Clock, answer, done_log, make_task, nothing_for, take

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


def test_an_assignment_says_how_many_sites_get_its_data(tm: TaskManager) -> None:
    """A broadcast's data goes to all its targets (the task server stores big fan-outs once);
    a send's or a relay's to one site at a time."""
    broadcast, to_two, send, relay = (make_task(name) for name in ("all", "two", "send", "relay"))
    tm.broadcast(broadcast)
    tm.broadcast(to_two, targets=["a", "b"])
    assert tm.next_task("a").receivers == 3
    answer(tm, broadcast.client_tasks[0])
    assert tm.next_task("a").receivers == 2
    tm.cancel(broadcast)
    tm.cancel(to_two)
    tm.send(send, ["b", "c"])
    assert tm.next_task("b").receivers == 1
    tm.cancel(send)
    tm.relay(relay, ["a", "b", "c"])
    assert tm.next_task("a").receivers == 1


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


def test_a_broadcast_result_wakes_no_other_sites_long_poll(tm: TaskManager) -> None:
    """Another site's result gives a waiting site nothing new: it is not woken (every result
    waking every waiting site cost sites^2 wake-ups a round)."""
    tm.broadcast(make_task(), min_responses=3)
    a, _ = take(tm, "a"), take(tm, "b")
    answer(tm, a)
    assert tm.wait_for_work(0, site="b") is False


def test_change_listeners_hear_whom_each_change_concerns(tm: TaskManager) -> None:
    """What the task server's dispatcher wakes on: one site's changes name that site (a
    broadcast result, a pick), changes for every site name none (a new task, a relay result
    that opens the next turn, a completion, a site gone)."""
    heard: list[str | None] = []
    tm.on_change(heard.append)
    tm.broadcast(make_task(), min_responses=2, targets=["a", "b"])
    assert heard == [None]
    a = take(tm, "a")
    answer(tm, a)
    assert heard[1:] == ["a", "a"]  # the pick, the result
    heard.clear()
    answer(tm, take(tm, "b"))  # the last: the task completes
    assert heard[:2] == ["b", "b"] and heard[2:] == [None]
    heard.clear()
    tm.site_gone("c")
    assert heard == [None]


def test_a_relay_result_wakes_the_site_whose_turn_it_opens(tm: TaskManager) -> None:
    tm.relay(make_task(), ["a", "b"])
    a = take(tm, "a")
    nothing_for(tm, "b")  # not its turn yet
    assert tm.wait_for_work(0, site="b") is False
    answer(tm, a)
    assert tm.wait_for_work(0, site="b") is True
    assert take(tm, "b").task.name == "train"


def test_a_site_gone_wakes_every_site(tm: TaskManager) -> None:
    tm.broadcast(make_task())
    take(tm, "a"), take(tm, "b")
    tm.site_gone("c")
    assert tm.wait_for_work(0, site="a") is True
    assert tm.wait_for_work(0, site="b") is True


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
