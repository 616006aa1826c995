"""The task server's long polls: parked without a thread each, answered by its dispatcher when a
change concerns their site (a broadcast to every site, the end of the run), when a send's turn
opens by the clock, or with TRY_AGAIN at their deadline, when the site asks again, or when the
server closes. A verdict on a result travels with the poll it came with."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog
from google.protobuf.message import Message

from fedhive.blobs import LocalBlobStore, TensorCodec
from fedhive.bus import Encoded, Pending
from fedhive.config import Settings
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.task_server import TaskServer
from fedhive.fl.tasks import Result, ReturnCode, SendOrder, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.names import Names
from fedhive.proto.v1 import task_pb2
from tests.fixtures.bus import given

_A = task_pb2.TaskAssignment
SITES = ["s1", "s2", "s3"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TaskServer]:
    store = LocalBlobStore(tmp_path / "blobs")
    store.ensure_bucket()
    codec = TensorCodec(store, Settings())
    log = structlog.get_logger()
    ctx = WorkflowContext(job_id="job-1", sites=SITES, workspace=tmp_path, log=log,
                          tasks=TaskManager(SITES, log=log), store=store, codec=codec,
                          names=Names("t"))
    server = TaskServer(ctx, service_user="services")
    yield server
    server.close()
    codec.close()
    store.close()


def answered(answer: Message | Encoded | Pending, timeout: float = 5) -> task_pb2.TaskAssignment:
    reply = given(answer, timeout)
    if isinstance(reply, Encoded):
        return reply.decode()
    assert isinstance(reply, _A), reply
    return reply


def not_yet(answer: Message | Encoded | Pending, wait: float = 0.3) -> None:
    assert isinstance(answer, Pending)
    with pytest.raises(queue.Empty):
        given(answer, wait)


def task(name: str = "train") -> Task:
    return Task(name, Dxo(DataKind.WEIGHTS, {"w": np.ones(4, np.float32)}))


def test_a_broadcast_answers_every_parked_poll_from_one_thread(server: TaskServer) -> None:
    before = threading.active_count()
    polls = [server.get_task(site, 10_000) for site in SITES]
    assert all(isinstance(poll, Pending) for poll in polls)
    assert threading.active_count() == before + 1  # the dispatcher, not a thread per site
    server.tasks.broadcast(task(), SITES, min_responses=3)
    got = [answered(poll) for poll in polls]
    assert [a.kind for a in got] == [_A.KIND_TASK] * 3
    assert len({a.task_id for a in got}) == 3 and {a.task_name for a in got} == {"train"}


def test_a_parked_poll_gets_try_again_at_its_deadline(server: TaskServer) -> None:
    poll = server.get_task("s1", 300)
    not_yet(poll, 0.1)
    assert answered(poll, 2).kind == _A.KIND_TRY_AGAIN


def test_a_site_asking_again_replaces_its_parked_poll(server: TaskServer) -> None:
    first = server.get_task("s1", 10_000)
    second = server.get_task("s1", 10_000)
    assert answered(first).kind == _A.KIND_TRY_AGAIN
    server.tasks.broadcast(task(), ["s1"], min_responses=1)
    assert answered(second).kind == _A.KIND_TASK


def test_a_poll_still_waiting_never_displaces_one_the_site_sent_meanwhile(
        server: TaskServer) -> None:
    """The dispatcher takes a poll out to answer it; the site asks again meanwhile; the first
    poll, still with nothing to do, is the one answered TRY_AGAIN, the new one stays parked."""
    first = server.get_task("s1", 10_000)
    with server._lock:  # what `_serve` does before it asks the task manager
        taken = server._polls.pop("s1")
    second = server.get_task("s1", 10_000)
    server._park("s1", taken, again=True)  # `_serve` found nothing to do yet
    assert answered(first).kind == _A.KIND_TRY_AGAIN
    server.tasks.broadcast(task(), ["s1"], min_responses=1)
    assert answered(second).kind == _A.KIND_TASK


def test_a_verdict_travels_with_the_poll_it_came_with(server: TaskServer) -> None:
    verdict = task_pb2.TaskResultReply(accepted=False, reason="late result")
    poll = server.get_task("s2", 10_000, verdict)
    server.tasks.end_run()
    reply = answered(poll)
    assert reply.kind == _A.KIND_END_RUN and reply.result == verdict


def test_the_end_of_the_run_answers_parked_polls_end_run(server: TaskServer) -> None:
    polls = [server.get_task(site, 10_000) for site in SITES]
    assert not server.all_ended()
    server.tasks.end_run()
    assert [answered(poll).kind for poll in polls] == [_A.KIND_END_RUN] * 3
    assert server.all_ended()


def test_a_send_turn_opening_by_the_clock_reaches_a_parked_poll(server: TaskServer) -> None:
    """s2 is the second target of a sequential send: eligible once the assignment timeout
    passed, with no change in between: the dispatcher must look at it by the clock."""
    server.tasks.send(task("validate"), ["s1", "s2"], SendOrder.SEQUENTIAL,
                      task_assignment_timeout=0.5)
    poll = server.get_task("s2", 10_000)
    not_yet(poll, 0.2)
    assert answered(poll, 3).kind == _A.KIND_TASK


def test_a_relay_result_reaches_the_next_sites_parked_poll(server: TaskServer) -> None:
    """s2's turn opens with s1's result: a change for every site, which wakes the dispatcher
    (one site's own change, as a broadcast result, does not)."""
    server.tasks.relay(task("relay"), ["s1", "s2"])
    first = answered(server.get_task("s1", 0))
    poll = server.get_task("s2", 10_000)
    not_yet(poll)
    server.tasks.submit("s1", first.task_id, Result(ReturnCode.OK, None))
    assert answered(poll).kind == _A.KIND_TASK


def test_closing_answers_parked_polls_try_again(server: TaskServer) -> None:
    poll = server.get_task("s3", 10_000)
    server.close()
    assert answered(poll).kind == _A.KIND_TRY_AGAIN
    assert answered(server.get_task("s3", 10_000)).kind == _A.KIND_TRY_AGAIN  # never parked


def test_only_results_whose_arrays_all_came_inline_are_quick() -> None:
    """Such a result waits on nothing (no stored object for S3 to confirm): the consumer folds
    it on its own thread; any other message goes to a handler thread."""
    inline = task_pb2.TaskResult(site="s1", return_code="OK")
    inline.data.tensors.add(name="w", dtype="float32", shape=[4], length=16,
                            inline_data=bytes(16))
    stored = task_pb2.TaskResult(site="s1", return_code="OK")
    stored.data.tensors.add(name="w", dtype="float32", shape=[4], length=16, key="k/blake3/ab")
    stored.data.tensors.add(name="b", dtype="float32", shape=[1], length=4, inline_data=bytes(4))
    assert TaskServer.quick(inline)
    assert TaskServer.quick(task_pb2.TaskResult(site="s1", return_code="OK"))  # no data
    assert not TaskServer.quick(stored)
    assert not TaskServer.quick(task_pb2.GetTaskRequest(site="s1", wait_ms=1000))
    assert not TaskServer.quick(task_pb2.GrantUploadRequest(site="s1"))
