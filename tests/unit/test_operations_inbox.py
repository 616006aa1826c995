"""The operations inbox: submitting, taking in order, idempotent op ids, ends, and closing."""

from __future__ import annotations

import threading
import time

import pytest

from fedhive.errors import FailedPrecondition, InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.operations import KEEP, Call, Operations


def call(op_id: str, task_name: str = "train", method: str = "bcast") -> Call:
    return Call(op_id=op_id, task_name=task_name, method=method, args={},
                data=Dxo(DataKind.WEIGHTS))


def test_next_returns_calls_in_submit_order_and_marks_them_taken() -> None:
    ops = Operations()
    first, second = call("op-1"), call("op-2", task_name="validate")
    assert ops.submit(first) is first
    assert ops.submit(second) is second
    assert first.taken_at is None and first.pending
    before = time.monotonic()
    assert ops.next(1.0) is first
    assert first.taken_at is not None and first.taken_at >= before
    assert second.taken_at is None
    assert ops.next(1.0) is second
    assert second.taken_at is not None
    assert ops.next(0) is None
    assert ops.get("op-1") is first


def test_the_same_op_id_again_returns_the_same_call_and_queues_nothing() -> None:
    ops = Operations()
    original = call("op-1")
    assert ops.submit(original) is original
    again = call("op-1")
    assert ops.submit(again) is original
    assert ops.next(0.5) is original
    assert ops.next(0) is None  # one queue entry only
    assert ops.submit(call("op-1")) is original  # still answered once taken


def test_the_same_op_id_after_its_end_returns_the_outcome() -> None:
    ops = Operations()
    original = ops.submit(call("op-1"))
    ops.finish(ops.next(0.5) or original, Dxo(DataKind.WEIGHTS, {"w": 1}), {})
    answer = ops.submit(call("op-1"))
    assert answer is original and not answer.pending
    assert answer.result is not None and answer.result.data == {"w": 1}


def test_the_same_op_id_with_another_task_is_refused() -> None:
    ops = Operations()
    ops.submit(call("op-1", task_name="train"))
    with pytest.raises(InvalidArgument) as info:
        ops.submit(call("op-1", task_name="validate"))
    assert info.value.field == "op_id"
    assert "'op-1'" in info.value.message
    assert "'train'" in info.value.message and "'validate'" in info.value.message


def test_the_same_op_id_with_another_method_is_refused() -> None:
    ops = Operations()
    ops.submit(call("op-1", method="bcast"))
    with pytest.raises(InvalidArgument):
        ops.submit(call("op-1", method="relay"))


def test_next_returns_none_after_the_timeout_when_empty() -> None:
    ops = Operations()
    start = time.monotonic()
    assert ops.next(0.2) is None
    assert time.monotonic() - start >= 0.19
    assert ops.next(0) is None


def test_finish_sets_done_result_and_contributions() -> None:
    ops = Operations()
    taken = ops.submit(call("op-1"))
    result = Dxo(DataKind.WEIGHTS, {"w": 2})
    ops.finish(taken, result, {"site-1": {"accepted": True}})
    assert taken.done.is_set() and not taken.pending
    assert taken.result is result
    assert taken.contributions == {"site-1": {"accepted": True}}
    assert taken.error == ""


def test_fail_sets_done_and_error() -> None:
    ops = Operations()
    failed = ops.submit(call("op-1"))
    ops.fail(failed, "site-1 timed out", {"site-1": "timeout"})
    assert failed.done.is_set()
    assert failed.error == "site-1 timed out"
    assert failed.result is None
    assert failed.contributions == {"site-1": "timeout"}
    other = ops.submit(call("op-2"))
    ops.fail(other, "")
    assert other.error == "the operation failed"
    assert other.contributions == {}


def test_close_fails_queued_calls_and_refuses_later_ones_with_the_reason() -> None:
    ops = Operations()
    taken, queued = ops.submit(call("op-1")), ops.submit(call("op-2"))
    assert ops.next(0.5) is taken
    ops.close("the job ended")
    assert queued.done.is_set() and queued.error == "the job ended"
    assert taken.pending  # the controller still owns the one it took
    assert ops.next(0) is None
    with pytest.raises(FailedPrecondition) as info:
        ops.submit(call("op-3"))
    assert "the job ended" in info.value.message
    assert info.value.field == "job_id"
    assert ops.submit(call("op-2")) is queued  # a known op id still answers its outcome


def test_a_waiting_next_is_woken_by_a_submit() -> None:
    ops = Operations()
    got: list[Call | None] = []
    waiter = threading.Thread(target=lambda: got.append(ops.next(10.0)))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.1)
    submitted = ops.submit(call("op-1"))
    waiter.join(5.0)
    assert not waiter.is_alive()
    assert got == [submitted]
    assert time.monotonic() - start < 5.0


def test_a_waiting_caller_sees_the_end_from_another_thread() -> None:
    ops = Operations()
    submitted = ops.submit(call("op-1"))

    def controller() -> None:
        taken = ops.next(5.0)
        assert taken is not None
        ops.finish(taken, Dxo(DataKind.WEIGHTS, {"w": 3}), {})

    worker = threading.Thread(target=controller)
    worker.start()
    assert submitted.done.wait(5.0)
    worker.join(5.0)
    assert submitted.result is not None and submitted.result.data == {"w": 3}


def test_only_the_last_keep_ended_calls_are_remembered() -> None:
    ops = Operations()
    calls = [ops.submit(call(f"op-{i}")) for i in range(KEEP)]
    for c in calls:
        assert ops.next(0) is c
        ops.finish(c, Dxo(DataKind.WEIGHTS), {})
    ops.submit(call(f"op-{KEEP}"))
    assert ops.get("op-0") is None
    assert ops.get("op-1") is calls[1]


def test_a_pending_oldest_call_is_never_forgotten() -> None:
    ops = Operations()
    oldest = ops.submit(call("op-0"))
    for i in range(1, KEEP + 2):
        ops.submit(call(f"op-{i}"))
    assert ops.get("op-0") is oldest
    assert ops.get(f"op-{KEEP + 1}") is not None
