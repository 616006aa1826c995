"""The task transport between a server job and its client jobs, on the real broker and S3.

The server side is the real `TaskServer` + `TaskManager` serving a job queue as the services'
broker user; each site is a real `Worker` loop on a thread of its own, connected as the site's
OWN broker user (deploy/broker_users.py) and holding no S3 credentials: it reads task data
through presigned URLs and uploads large results through the server's grants
(tests/fixtures/task_transport.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedhive.blobs import (
    Attachment,
    PresignedFetcher,
    TensorKind,
    TensorRef,
    add_ref,
    checksum,
    content_key,
    ref_from_proto,
    ref_to_proto,
    unpack,
)
from fedhive.blobs.keys import upload_key
from fedhive.bus import Encoded, RabbitBus, Senders
from fedhive.config import Settings
from fedhive.errors import PermissionDenied, Unroutable
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask, Executors
from fedhive.fl.task_server import TaskServer
from fedhive.fl.tasks import CompletionStatus, ReturnCode, Task
from fedhive.names import Names
from fedhive.proto.v1 import runner_pb2, site_pb2, task_pb2
from tests.fixtures.infra import RUN_ID, wait_for
from tests.fixtures.sites import collect
from tests.fixtures.task_transport import Job, client_job
from tests.fixtures.task_transport import job as job
from tests.fixtures.task_transport import site_settings as site_settings

SEEN: dict[tuple[str, str], dict[str, Any]] = {}  # (job, site) -> the arrays a site loaded
_A = task_pb2.TaskAssignment


class Doubler:
    def execute(self, task: ExecTask) -> Dxo:
        loaded = task.load()
        SEEN[(task.job_id, task.site)] = loaded.data
        return Dxo(DataKind.WEIGHTS, {name: value * 2 for name, value in loaded.data.items()},
                   {MetaKey.NUM_STEPS_CURRENT_ROUND: 3, "site": task.site})


class Factor:
    def __init__(self, value: float) -> None:
        self.value = value


class Scaler:
    """Scales by the client config's component "factor" (built before the executors)."""

    def execute(self, task: ExecTask) -> Dxo:
        factor = task.components["factor"].value
        return Dxo(DataKind.WEIGHTS, {n: v * factor for n, v in task.load().data.items()})


class Boom:
    def execute(self, task: ExecTask) -> Dxo:
        raise RuntimeError("kaboom\nsecond line")


def executors(**by_task: str) -> Executors:
    return Executors.from_config({"executors": [
        {"tasks": [name], "executor": {"path": f"{__name__}.{cls}"}}
        for name, cls in by_task.items()]})


@pytest.fixture(scope="module")
def namespace() -> str:
    """One namespace and one set of broker users for the module: creating users takes seconds."""
    return f"t{RUN_ID}-flt"


def test_broadcast_round_trip_inline_and_through_s3(job: Job) -> None:
    rng = np.random.default_rng(7)
    model = {"small": np.arange(16, dtype=np.float32),  # inline both ways
             "big": rng.standard_normal(100_000).astype(np.float32),  # 400 KB: S3 both ways
             "ints": np.arange(-5, 5, dtype=np.int64).reshape(2, 5)}
    for letter in "ab":
        job.start_worker(letter, executors(train="Doubler"))
    task = Task("train", Dxo(DataKind.WEIGHTS, model, {MetaKey.CURRENT_ROUND: 0}))
    job.tasks.broadcast(task, min_responses=2)
    job.finish(task)

    assert task.completion_status is CompletionStatus.OK
    prefix = job.ctx.tensor_prefix
    for client_task in task.client_tasks:
        # what the site loaded through presigned URLs is bit-exact what the server sent
        loaded = SEEN[(job.ctx.job_id, client_task.site)]
        assert {n: v.tobytes() for n, v in loaded.items()} == \
            {n: v.tobytes() for n, v in model.items()}
        result = client_task.result
        assert result is not None and result.ok and result.dxo is not None
        assert result.dxo.is_lazy  # the server job holds refs until a workflow reads them
        big = result.dxo.data["big"]
        assert isinstance(big, TensorRef)
        # uploaded by the site through a grant, to its own key for the task
        assert big.key == upload_key(prefix, client_task.site, client_task.id, big.checksum)
        assert big.url == ""
        assert job.store.exists(big.key)
        assert result.dxo.data["small"].is_inline and result.dxo.data["ints"].is_inline
        arrays = result.dxo.materialized(job.store).data
        assert {n: v.tobytes() for n, v in arrays.items()} == \
            {n: (v * 2).tobytes() for n, v in model.items()}
        assert arrays["ints"].dtype == np.int64 and arrays["ints"].shape == (2, 5)
        assert result.dxo.meta == {MetaKey.NUM_STEPS_CURRENT_ROUND: 3,
                                   "site": client_task.site}

    # A result forwarded as the next task's data (the cyclic relay): its refs carry no URL
    # from the site; the server presigns them, and the next site reads them without fetching
    # anything through the server.
    forwarded = task.client_tasks[0].result
    forwarded_id = task.client_tasks[0].id
    assert forwarded is not None and forwarded.dxo is not None
    relay = Task("train", forwarded.dxo)
    job.tasks.send(relay, [job.site("b")])
    job.finish(relay)
    result = relay.client_tasks[0].result
    assert result is not None and result.ok and result.dxo is not None
    assert SEEN[(job.ctx.job_id, job.site("b"))]["big"].tobytes() == (model["big"] * 2).tobytes()
    assert result.dxo.materialized(job.store).data["big"].tobytes() == \
        (model["big"] * 4).tobytes()

    # Grants are for a task of the site awaiting its result: none is left
    with pytest.raises(PermissionDenied, match="no upload grant"):
        job.call("a", task_pb2.GrantUploadRequest(
            job_id=job.ctx.job_id, site=job.site("a"), task_id=forwarded_id,
            checksums=[big.checksum]), task_pb2.UploadGrant)


def test_a_broadcast_is_encoded_once_and_signed_again_near_expiry(job: Job) -> None:
    """Every site of a broadcast gets the same encoded data (packed and presigned once); its
    URLs are signed again once they come within the margin of their expiry (half the TTL)."""
    big = np.arange(50_000, dtype=np.float32)  # through S3: its ref carries a presigned URL

    def assignments(server: TaskServer, letters: str) -> list[Any]:
        task = Task("train", Dxo(DataKind.WEIGHTS, {"big": big}, {MetaKey.CURRENT_ROUND: 0}))
        job.tasks.broadcast(task, min_responses=2)
        encoded = []
        for letter in letters:
            reply = server.get_task(job.site(letter), 0)
            assert isinstance(reply, Encoded) and reply.message_type is _A
            encoded.append((reply.decode(), reply.body))
        job.tasks.cancel(task)
        return encoded

    service_user = job.server._service_user
    (a, body_a), (b, body_b) = assignments(TaskServer(job.ctx, service_user=service_user), "ab")
    assert a.kind == b.kind == _A.KIND_TASK and a.task_id != b.task_id
    assert a.data == b.data and a.data.tensors[0].url  # one encoding, one signature
    assert body_a is body_b and _A.FromString(body_a) == _A(data=a.data)  # shared as it is

    short = TaskServer(job.ctx, service_user=service_user, url_ttl_s=2)  # re-sign after 1 s
    ((first, _),) = assignments(short, "a")
    time.sleep(1.2)
    ((second, _),) = assignments(short, "b")
    assert second.data.tensors[0].url != first.data.tensors[0].url
    assert second.data.tensors[0].url_expires_at_ms > first.data.tensors[0].url_expires_at_ms


def test_a_broadcast_past_the_fan_out_budget_sends_its_inline_bytes_through_s3(
        job: Job) -> None:
    """A broadcast whose inline bytes, once per site, would pass the fan-out budget stores them
    once at their content key and sends each site a presigned ref instead, which a site
    reads without credentials; a send (one site) under the same budget keeps them inline."""
    model = {"w": np.arange(16, dtype=np.float32), "ints": np.arange(4, dtype=np.int64)}
    server = TaskServer(job.ctx, service_user=job.server._service_user,
                        fan_out_budget=2 * 96 - 1)  # 96 inline bytes to each of two sites

    def data(task: Task, letter: str) -> Any:
        reply = server.get_task(job.site(letter), 0)
        assert isinstance(reply, Encoded)
        assignment = reply.decode()
        assert assignment.task_id in {ct.id for ct in task.client_tasks}
        return assignment.data

    broadcast = Task("train", Dxo(DataKind.WEIGHTS, model, {MetaKey.CURRENT_ROUND: 0}))
    job.tasks.broadcast(broadcast, min_responses=2)
    sent = data(broadcast, "a")
    assert data(broadcast, "b") == sent  # one encoding for both sites
    refs = [ref_from_proto(ref) for ref in sent.tensors]
    for ref in refs:
        assert ref.key == content_key(job.ctx.tensor_prefix, ref.checksum)
        assert ref.url and not ref.inline_data and job.store.exists(ref.key)
    loaded = unpack(refs, PresignedFetcher())
    assert {n: v.tobytes() for n, v in loaded.items()} == \
        {n: v.tobytes() for n, v in model.items()}
    job.tasks.cancel(broadcast)

    send = Task("train", Dxo(DataKind.WEIGHTS, model, {MetaKey.CURRENT_ROUND: 1}))
    job.tasks.send(send, [job.site("a")])
    assert all(ref.attached and not ref.key for ref in data(send, "a").tensors)
    job.tasks.cancel(send)


def test_executor_errors_and_unknown_tasks_become_results(job: Job) -> None:
    job.start_worker("a", executors(boom="Boom"))
    boom = Task("boom", Dxo(DataKind.WEIGHTS, {"w": np.ones(3, np.float32)}))
    job.tasks.send(boom, [job.site("a")])
    job.finish(boom)
    result = boom.client_tasks[0].result
    assert result is not None
    assert (result.return_code, result.error, result.dxo) == (
        ReturnCode.EXECUTION_EXCEPTION, "RuntimeError: kaboom second line", None)

    job.start_worker("b", Executors.from_config({
        "components": [{"id": "factor", "path": f"{__name__}.Factor", "args": {"value": 3}}],
        "executors": [{"tasks": ["scale"], "executor": {"path": f"{__name__}.Scaler"}}]}))
    scale = Task("scale", Dxo(DataKind.WEIGHTS, {"w": np.ones(3, np.float32)}))
    job.tasks.send(scale, [job.site("b")])
    job.finish(scale)
    result = scale.client_tasks[0].result
    assert result is not None and result.ok and result.dxo is not None
    np.testing.assert_array_equal(result.dxo.materialized(job.store).data["w"], [3.0] * 3)

    mystery = Task("mystery", Dxo(DataKind.WEIGHTS, {}))
    job.tasks.send(mystery, [job.site("a")])
    job.finish(mystery)
    result = mystery.client_tasks[0].result
    assert result is not None and result.return_code == ReturnCode.TASK_UNKNOWN
    assert "no executor for task 'mystery'" in result.error


def test_end_run_ends_every_worker(job: Job) -> None:
    for letter in "ab":
        job.start_worker(letter, executors(train="Doubler"))
    job.tasks.end_run()
    for letter, (worker, thread) in job.workers.items():
        thread.join(timeout=15)
        assert not thread.is_alive(), f"worker {letter} still runs after END_RUN"
        assert worker.current_task == "ended"
    assert job.server.all_ended()


def test_results_the_server_cannot_take_are_refused_with_a_reason(job: Job) -> None:
    a = job.site("a")
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(4, np.float32)}))
    job.tasks.send(task, [a])
    # site a polls by hand: the task, with its data inline (small: attached to the reply)
    assignment, attached = job.bus("a").call_attached(
        job.route("a"), task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=a, wait_ms=5000),
        _A, timeout=20)
    assert (assignment.kind, assignment.task_name) == (_A.KIND_TASK, "train")
    assert ref_from_proto(assignment.data.tensors[0], attached).inline_data == \
        np.ones(4, np.float32).tobytes()

    # a ref to an object the server never granted: rejected, and the workflow sees an error
    stray = TensorRef(name="w", dtype="float32", shape=(4,), kind=TensorKind.NUMPY,
                      key=f"{job.ctx.tensor_prefix}elsewhere/w.bin", length=16,
                      checksum="sha256:" + "0" * 64)
    forged = task_pb2.TaskResult(job_id=job.ctx.job_id, site=a, task_id=assignment.task_id,
                                 task_name="train", return_code=ReturnCode.OK,
                                 data=task_pb2.Dxo(data_kind=task_pb2.DATA_KIND_WEIGHTS,
                                                   tensors=[ref_to_proto(stray)]))
    reply = job.call("a", forged, task_pb2.TaskResultReply)
    assert not reply.accepted
    assert reply.reason.startswith(f"result data rejected: job {job.ctx.job_id} site {a} "
                                   "task 'train': tensor 'w': key")
    job.finish(task)
    result = task.client_tasks[0].result
    assert result is not None and result.return_code == ReturnCode.EXECUTION_RESULT_ERROR

    # a result for a task that is over: refused, with the task manager's reason
    late = task_pb2.TaskResult(job_id=job.ctx.job_id, site=a, task_id=assignment.task_id,
                               task_name="train", return_code=ReturnCode.OK)
    reply = job.call("a", late, task_pb2.TaskResultReply)
    assert not reply.accepted and reply.reason


def test_a_results_inline_arrays_travel_attached_and_must_lie_within_the_attachment(
    job: Job,
) -> None:
    """A site's inline arrays follow its result message (`Encoded.attaching`): the server
    reads them from there, checksum verified; a ref naming bytes past the attachment is
    refused with a reason naming the tensor."""
    a = job.site("a")
    sent = np.arange(4, dtype=np.float32)

    def result(task_id: str, offset: int) -> Encoded:
        dxo, attachment = task_pb2.Dxo(data_kind=task_pb2.DATA_KIND_WEIGHTS), Attachment()
        add_ref(dxo.tensors, TensorRef(name="w", dtype="float32", shape=(4,),
                                       kind=TensorKind.NUMPY, length=16,
                                       checksum=checksum.digest(sent.view(np.uint8)),
                                       inline_data=sent.tobytes()), attachment)
        dxo.tensors[0].offset += offset
        message = task_pb2.TaskResult(job_id=job.ctx.job_id, site=a, task_id=task_id,
                                      task_name="train", return_code=ReturnCode.OK, data=dxo)
        return Encoded.attaching(task_pb2.TaskResult, message.SerializeToString(),
                                 attachment.parts)

    for offset, accepted in ((0, True), (4, False)):
        task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(4, np.float32)}))
        job.tasks.send(task, [a])
        assignment = job.call("a", task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=a,
                                                           wait_ms=5000), _A)
        reply = job.call("a", result(assignment.task_id, offset), task_pb2.TaskResultReply)
        assert reply.accepted is accepted, reply.reason
        job.finish(task)
        got = task.client_tasks[0].result
        assert got is not None
        if accepted:
            assert got.dxo is not None
            assert np.array_equal(got.dxo.materialized(job.ctx.store).data["w"], sent)
        else:
            assert got.return_code == ReturnCode.EXECUTION_RESULT_ERROR
            assert "tensor ref 'w': attached bytes [4, 20) are not within the message's " \
                   "attachment (16 bytes)" in reply.reason


def test_a_result_asking_for_more_is_answered_with_the_next_assignment(job: Job) -> None:
    """One round trip per task: a result sent with `next_wait_ms` is answered with the site's
    next assignment (a long poll), which carries the verdict on the result."""
    a = job.site("a")
    first = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(4, np.float32)}))
    job.tasks.send(first, [a])
    assignment = job.call("a", task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=a,
                                                       wait_ms=5000), _A)
    done = task_pb2.TaskResult(job_id=job.ctx.job_id, site=a, task_id=assignment.task_id,
                               task_name="train", return_code=ReturnCode.OK,
                               next_wait_ms=10_000)
    second = Task("validate", Dxo(DataKind.WEIGHTS, {}))
    later = threading.Timer(0.5, lambda: job.tasks.send(second, [a]))  # while the reply waits
    later.start()
    reply = job.call("a", done, _A)
    later.join()
    assert (reply.result.accepted, reply.result.reason) == (True, "")
    assert (reply.kind, reply.task_name) == (_A.KIND_TASK, "validate")
    job.finish(first)
    assert first.completion_status is CompletionStatus.OK
    job.tasks.cancel(second)

    # refused (its task is over): the verdict says why, and the poll still runs its course
    reply = job.call("a", task_pb2.TaskResult(
        job_id=job.ctx.job_id, site=a, task_id=assignment.task_id, task_name="train",
        return_code=ReturnCode.OK, next_wait_ms=200), _A)
    assert (reply.kind, reply.result.accepted) == (_A.KIND_TRY_AGAIN, False)
    assert reply.result.reason
    job.tasks.end_run()
    reply = job.call("a", task_pb2.TaskResult(
        job_id=job.ctx.job_id, site=a, task_id=reply.task_id or "none", task_name="train",
        return_code=ReturnCode.OK, next_wait_ms=200), _A)
    assert reply.kind == _A.KIND_END_RUN and not reply.result.accepted


def test_a_site_speaks_only_for_itself(job: Job, make_bus: Callable[..., RabbitBus],
                                       rogue_settings: Settings) -> None:
    a, b = job.site("a"), job.site("b")
    names = Names(rogue_settings.namespace)
    poll_b = task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=b, wait_ms=0)
    with pytest.raises(PermissionDenied, match=f"sent by broker user '{names.site_user(a)}'"):
        job.call("a", poll_b, _A)  # site a claiming to be b (RabbitMQ verified the user_id)
    # allowed everything, neither a site nor the runner (direct reply-to: it is no service)
    rogue = RabbitBus(rogue_settings, name="rogue", site=True)
    try:
        with pytest.raises(PermissionDenied, match="does not accept messages from broker user"):
            rogue.call(job.queue, poll_b, _A, timeout=20)
    finally:
        rogue.close()
    c = job.site("c")  # a site, but not of this job: its key of the job is bound by nobody
    with pytest.raises(Unroutable):
        job.call("c", task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=c), _A)
    assert job.call("b", poll_b, _A).kind == _A.KIND_TRY_AGAIN  # b itself may ask

    # SiteGone only counts from the services' user (the runner), never from a site
    job.bus("a").send(job.route("a"), runner_pb2.SiteGone(job_id=job.ctx.job_id, site=b,
                                                          reason="forged by a"))
    make_bus(name="runner").send(job.queue, runner_pb2.SiteGone(
        job_id=job.ctx.job_id, site=b, reason="site went offline"))
    wait_for(lambda: job.ctx.gone_sites(), timeout=10, what="the runner's SiteGone")
    assert job.ctx.gone_sites() == {b: "site went offline"}
    assert job.tasks.active_sites() == [a]


def test_a_client_job_with_a_bad_executor_config_leaves_the_job(job: Job, tmp_path: Path,
                                                                 ) -> None:
    a = job.site("a")
    site_dir, argv, env, app = client_job(job, tmp_path, "a", {"executors": [
        {"tasks": ["train"], "executor": {"id": "trainer", "path": "nowhere.Trainer"}}]})
    done = subprocess.run(argv, cwd=app, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert "component 'trainer': cannot import 'nowhere.Trainer'" in done.stderr
    gone = wait_for(lambda: job.ctx.gone_sites(), timeout=10, what="the WorkerExit")
    assert gone[a].startswith("client job could not start: ") and "nowhere.Trainer" in gone[a]
    assert job.tasks.active_sites() == [job.site("b")]
    report = site_dir / "workspace" / ".agent" / "jobs" / f"{job.ctx.job_id}.cj.json"
    assert json.loads(report.read_text())["broker_user"] == Names(
        job.site_settings["a"].namespace).site_user(a)  # it reported itself first


def test_a_client_job_beats_while_it_waits_and_stops_on_sigterm(
    job: Job, tmp_path: Path, make_bus: Callable[..., RabbitBus]
) -> None:
    beats: list[tuple[str, Any]] = []
    watch = make_bus(name="watch")
    watch.subscribe("fl-transport-watch", ["site.*.job"], collect(beats),
                    [site_pb2.JobHeartbeat], senders=Senders.any_site(watch.names))
    _, argv, env, app = client_job(job, tmp_path, "a", {"executors": []})
    with (tmp_path / "cj.log").open("wb") as log:
        proc = subprocess.Popen(argv, cwd=app, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # the first beat says it started, later ones (every 0.5 s) that it waits for work
        wait_for(lambda: [b for _, b in beats if b.current_task == "waiting"], timeout=20,
                 what="a heartbeat of the waiting client job")
        assert beats[0][1].current_task == "started"
        assert {key for key, _ in beats} == {f"site.{job.site('a')}.job"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
