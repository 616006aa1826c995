"""The client API's pipe: framing, request/reply pairing, the trainer's API against a scripted
client job, and ClientAPIExecutor with real trainer processes (inline data: no S3 needed)."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

import fedhive.client as flare
from fedhive.blobs import PresignedUrl
from fedhive.client import api as client_api
from fedhive.client.api import ClientAPI
from fedhive.client.hygiene import clean_memory
from fedhive.client.pipe import Message, Pipe, PipeClosed, Requests, error_reply
from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.fl.client_api_executor import ClientAPIExecutor
from fedhive.fl.dxo import DataKind, Dxo, MetaKey, dxo_from_proto, dxo_to_proto
from fedhive.fl.executor import ExecTask, TaskError
from fedhive.fl.model import FLModel
from fedhive.fl.tasks import ReturnCode
from fedhive.proto.v1 import client_pb2, common_pb2, task_pb2

KiB = 1024


@pytest.fixture
def pair() -> Iterator[tuple[Pipe, Pipe]]:
    a, b = socket.socketpair()
    left, right = Pipe(a), Pipe(b)
    yield left, right
    left.close()
    right.close()


# framing ----------------------------------------------------------------------------------
def test_frames_cross_in_order_and_a_clean_eof_is_none(pair: tuple[Pipe, Pipe]) -> None:
    left, right = pair
    left.send(Message(seq=1, hello=client_pb2.TrainerHello(pid=7, rank="0")))
    left.send(Message(stop=client_pb2.TrainerStop(reason="over")))
    first, second = right.recv(), right.recv()
    assert first is not None and (first.seq, first.hello.pid) == (1, 7)
    assert second is not None and second.stop.reason == "over"
    left.close()
    assert right.recv() is None


def test_eof_inside_a_frame_and_bad_frames_are_errors() -> None:
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 100) + b"short")
    a.close()
    with pytest.raises(PipeClosed, match="inside a frame"):
        Pipe(b).recv()

    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 2**31))
    with pytest.raises(MalformedMessage, match="exceeds"):
        Pipe(b, max_frame=1024).recv()
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 3) + b"\xff\xff\xff")
    with pytest.raises(MalformedMessage, match="does not decode"):
        Pipe(b).recv()
    with pytest.raises(MalformedMessage, match="exceeds"):
        Pipe(a, max_frame=8).send(Message(stop=client_pb2.TrainerStop(reason="x" * 100)))


def test_concurrent_requests_get_their_own_replies_and_errors_keep_their_type(
    pair: tuple[Pipe, Pipe],
) -> None:
    left, right = pair
    requests = Requests(left)

    def peer() -> None:  # answers in reverse order of arrival
        pending = []
        while len(pending) < 4:
            message = right.recv()
            assert message is not None
            pending.append(message)
        for message in reversed(pending):
            keys = list(message.resign.keys)
            if keys == ["forbidden"]:
                right.send(error_reply(message.seq, PermissionDenied("not yours", field="k")))
            else:
                right.send(Message(seq=message.seq, resign_reply=task_pb2.ResignReply(
                    urls=[task_pb2.SignedUrl(key=keys[0], url=f"u-{keys[0]}")])))

    def reader() -> None:
        while (message := left.recv()) is not None:
            requests.answer(message)

    threading.Thread(target=peer, daemon=True).start()
    threading.Thread(target=reader, daemon=True).start()
    answers: dict[str, Any] = {}

    def ask(key: str) -> None:
        try:
            reply = requests.call(timeout=10, resign=task_pb2.ResignRequest(keys=[key]))
            answers[key] = reply.resign_reply.urls[0].url
        except PermissionDenied as err:
            answers[key] = err

    threads = [threading.Thread(target=ask, args=(k,)) for k in ("a", "b", "c", "forbidden")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert {k: answers[k] for k in "abc"} == {"a": "u-a", "b": "u-b", "c": "u-c"}
    assert isinstance(answers["forbidden"], PermissionDenied)
    assert (str(answers["forbidden"]), answers["forbidden"].field) == ("not yours", "k")


def test_a_closed_pipe_fails_waiting_and_later_requests(pair: tuple[Pipe, Pipe]) -> None:
    left, _ = pair
    requests = Requests(left)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            requests.call(timeout=10, resign=task_pb2.ResignRequest(keys=["k"]))
        except PipeClosed as err:
            failure.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)  # let it send and wait (the outcome does not depend on it)
    requests.fail_all(PipeClosed("the client job closed the pipe"))
    thread.join(10)
    assert failure and "the client job closed the pipe" in str(failure[0])
    with pytest.raises(PipeClosed):
        requests.call(timeout=1, resign=task_pb2.ResignRequest(keys=["k"]))


# the trainer's API against a scripted client job -----------------------------------------
class FakeClientJob:
    """The CJ end of a pipe: answers hello, records results, refuses upload grants."""

    def __init__(self, sock: socket.socket, inline_threshold: int = 64 * KiB) -> None:
        self.pipe = Pipe(sock)
        self.config = client_pb2.TrainerConfig(job_id="j1", site="s1",
                                               inline_threshold=inline_threshold,
                                               inline_budget=8 * inline_threshold)
        self.results: list[client_pb2.TrainerResult] = []
        self.got_result = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def task(self, data: Dxo, task_id: str = "t1", name: str = "train") -> None:
        self.pipe.send(Message(task=client_pb2.TrainerTask(
            task_id=task_id, task_name=name, data=dxo_to_proto(data, _inline))))

    def _serve(self) -> None:
        while (message := self.pipe.recv()) is not None:
            kind = message.WhichOneof("body")
            if kind == "hello":
                self.pipe.send(Message(seq=message.seq, config=self.config))
            elif kind == "result":
                self.results.append(message.result)
                self.pipe.send(Message(seq=message.seq, ack=common_pb2.Ack()))
                self.got_result.set()
            else:
                self.pipe.send(error_reply(message.seq, PermissionDenied("no uploads here")))


def _inline(arrays: Any) -> list[Any]:
    from fedhive.blobs import TensorKind, TensorRef, checksum

    refs = []
    for name, array in arrays.items():
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        refs.append(TensorRef(name=name, dtype=array.dtype.name, shape=tuple(array.shape),
                              kind=TensorKind.NUMPY, length=flat.nbytes,
                              checksum=checksum.digest(flat), inline_data=flat.tobytes()))
    return refs


@pytest.fixture
def trainer() -> Iterator[tuple[ClientAPI, FakeClientJob]]:
    ours, theirs = socket.socketpair()
    cj = FakeClientJob(ours)
    api = ClientAPI(theirs, "0")
    yield api, cj
    api.close()
    cj.pipe.close()


def test_receive_send_and_stop(trainer: tuple[ClientAPI, FakeClientJob]) -> None:
    api, cj = trainer
    assert (api.config.job_id, api.config.site) == ("j1", "s1")
    with pytest.raises(RuntimeError, match='"receive" needs to be called before sending'):
        api.send(FLModel(params={}))
    weights = {"w": np.arange(6, dtype=np.float16).reshape(2, 3), "m": np.array([True, False])}
    cj.task(Dxo(DataKind.WEIGHTS, weights, {MetaKey.CURRENT_ROUND: 2, MetaKey.TOTAL_ROUNDS: 5}))
    model = api.receive(timeout=10)
    assert model is not None and api.receive() is model  # the same until send
    assert (model.current_round, model.total_rounds, api.task_name) == (2, 5, "train")
    assert model.params["w"].dtype == np.float16 and model.params["w"].tolist() == \
        weights["w"].tolist()
    with pytest.raises(TypeError, match="expected an FLModel"):
        api.send({"w": 1})  # type: ignore[arg-type]
    api.send(FLModel(params={"w": model.params["w"] + 1}, metrics={"loss": 0.5}))
    (result,) = cj.results
    assert (result.task_id, result.return_code) == ("t1", ReturnCode.OK)
    sent = dxo_from_proto(result.data)
    assert sent.meta[MetaKey.METRICS] == {"loss": 0.5}
    assert sent.data["w"].is_inline
    with pytest.raises(RuntimeError, match='"receive" needs to be called'):
        api.send(FLModel(params={}))  # the task was answered

    cj.pipe.send(Message(stop=client_pb2.TrainerStop(reason="END_RUN")))
    assert api.receive() is None and not api.is_running()
    assert api.stop_reason == "END_RUN"


def test_a_result_that_cannot_be_sent_is_reported_as_the_tasks_error(
    trainer: tuple[ClientAPI, FakeClientJob],
) -> None:
    api, cj = trainer
    cj.task(Dxo(DataKind.WEIGHTS, {"w": np.ones(2, np.float32)}))
    assert api.receive(timeout=10) is not None
    with pytest.raises(PermissionDenied, match="no uploads here"):
        api.send(FLModel(params={"big": np.ones(64 * KiB, np.float32)}))  # must be uploaded
    (result,) = cj.results
    assert result.return_code == ReturnCode.EXECUTION_EXCEPTION
    assert result.error == ("the trainer's result could not be sent: PermissionDenied: "
                            "no uploads here")


def test_memory_hygiene_after_send_when_the_executor_asks(
    trainer: tuple[ClientAPI, FakeClientJob], monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, cj = trainer
    cleaned: list[dict[str, bool]] = []
    monkeypatch.setattr(client_api, "clean_memory", lambda: cleaned.append(clean_memory()))
    cj.task(Dxo(DataKind.WEIGHTS, {"w": np.ones(2, np.float32)}))
    assert api.receive(timeout=10) is not None
    api.send(FLModel(params={}))
    assert cleaned == []  # off by default
    api.config.memory_hygiene = True
    cj.task(Dxo(DataKind.WEIGHTS, {"w": np.ones(2, np.float32)}), task_id="t2")
    assert api.receive(timeout=10) is not None
    api.send(FLModel(params={}))
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    assert cleaned == [{"gc": True, "malloc_trim": sys.platform == "linux",
                        "cuda_empty_cache": cuda}]


def test_the_client_job_going_away_ends_the_run(trainer: tuple[ClientAPI, FakeClientJob]) -> None:
    api, cj = trainer
    cj.pipe.close()
    assert api.receive(timeout=10) is None
    assert "closed the pipe" in api.stop_reason


def test_calls_before_init_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flare, "_rank", None)
    monkeypatch.setattr(flare, "_api", None)
    for call in (flare.receive, flare.is_running, flare.get_job_id):
        with pytest.raises(RuntimeError, match=r"APIContext is None\. Did you call "
                                               r"fedhive\.client\.init\(\)"):
            call()
    monkeypatch.delenv("FEDHIVE_CLIENT_FD", raising=False)
    with pytest.raises(RuntimeError, match="FEDHIVE_CLIENT_FD is not set"):
        flare.init()
    flare.init(rank=1)  # other ranks do not talk to the client job
    with pytest.raises(RuntimeError, match="only rank 0 can call receive!"):
        flare.receive()
    with pytest.warns(UserWarning, match="called already"):
        flare.init()
    flare.shutdown()


# ClientAPIExecutor with real trainer processes ----------------------------------------------
TRAINER = """
import sys
from fedhive import client as flare
flare.init()
while flare.is_running():
    model = flare.receive()
    if model.meta.get("behaviour") == "hang":
        import time
        time.sleep(600)
    if model.meta.get("behaviour") == "badref":  # a result naming some other object
        from fedhive.proto.v1 import client_pb2, common_pb2, task_pb2
        api = flare._api
        ref = common_pb2.TensorRef(name="w", dtype="float32", shape=[1], kind=1, length=4,
                                   key="elsewhere/w.bin", checksum="sha256:" + "0" * 64)
        api._requests.call(result=client_pb2.TrainerResult(
            task_id=api.task.task_id, return_code="OK",
            data=task_pb2.Dxo(data_kind=1, tensors=[ref])))
        api.task = api.model = None
        continue
    flare.send(flare.FLModel(params={k: v * 3 for k, v in model.params.items()},
                             metrics={"rank": 0}))
"""


class NoServer:
    def grant(self, checksums: list[str], sizes: list[int]) -> task_pb2.UploadGrant:
        raise AssertionError("inline data needs no grant")

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        raise AssertionError("inline data needs no upload")

    def resign(self, keys: list[str]) -> dict[str, PresignedUrl]:
        raise AssertionError("inline data needs no URL")


@pytest.fixture
def exec_task(tmp_path: Path) -> Callable[..., ExecTask]:
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "unit_trainer.py").write_text(TRAINER)

    def make(data: dict[str, Any], task_id: str = "t1", **meta: Any) -> ExecTask:
        dxo = dxo_from_proto(dxo_to_proto(Dxo(DataKind.WEIGHTS, data, meta), _inline))
        return ExecTask(name="train", data=dxo, props={}, job_id="j1", site="s1",
                        workspace=tmp_path, abort=threading.Event(),
                        log=structlog.get_logger(), fetcher=None,  # type: ignore[arg-type]
                        task_id=task_id, server=NoServer())

    return make


def test_the_executor_relays_a_task_to_a_trainer_it_launches_once(
    exec_task: Callable[..., ExecTask],
) -> None:
    executor = ClientAPIExecutor("python -m unit_trainer", stop_grace=5)
    try:
        for index in range(2):
            out = executor.execute(exec_task({"w": np.arange(4, dtype=np.int64)},
                                             task_id=f"t{index}", current_round=index))
            assert out.meta[MetaKey.METRICS] == {"rank": 0}
            ref = out.data["w"]
            assert np.frombuffer(ref.inline_data, np.int64).tolist() == [0, 3, 6, 9]
        assert executor.launches == 1
    finally:
        executor.finalize()


def test_the_executor_fails_tasks_clearly(exec_task: Callable[..., ExecTask]) -> None:
    where = "job j1 site s1 task 'train' round 4"
    with pytest.raises(TaskError, match=f"^{where}: the trainer exited with code 5 before"):
        ClientAPIExecutor(f"{sys.executable} -c 'raise SystemExit(5)'").execute(
            exec_task({}, current_round=4))
    with pytest.raises(TaskError, match=f"^{where}: cannot start the trainer"):
        ClientAPIExecutor("/nonexistent/trainer").execute(exec_task({}, current_round=4))
    with pytest.raises(TaskError, match=r"did not call fedhive.client.init\(\) within 0.5 s"):
        ClientAPIExecutor(f"{sys.executable} -c 'import time; time.sleep(60)'",
                          launch_timeout=0.5, stop_grace=1).execute(exec_task({},
                                                                              current_round=4))
    executor = ClientAPIExecutor("python -m unit_trainer", task_timeout=1, stop_grace=1)
    with pytest.raises(TaskError, match="sent no result within 1 s; it was stopped"):
        executor.execute(exec_task({"w": np.ones(2)}, behaviour="hang"))
    assert executor._trainer is None
    executor.finalize()
    # the client job never fetches what a trainer points at: only inline or uploaded refs (a
    # trainer of its own, with time to start on a loaded machine: 1 s is for the hang above)
    executor = ClientAPIExecutor("python -m unit_trainer", task_timeout=60, stop_grace=1)
    with pytest.raises(TaskError, match=r"tensor 'w' of the trainer's result is not inline "
                                        r"nor at a key named by its checksum "
                                        r"\(elsewhere/w.bin\)"):
        executor.execute(exec_task({"w": np.ones(2)}, behaviour="badref"))
    executor.finalize()


def test_abort_stops_the_trainer(exec_task: Callable[..., ExecTask]) -> None:
    executor = ClientAPIExecutor("python -m unit_trainer", stop_grace=1)
    task = exec_task({"w": np.ones(2)}, behaviour="hang")
    threading.Timer(1.0, task.abort.set).start()
    with pytest.raises(TaskError) as caught:
        executor.execute(task)
    assert caught.value.return_code == ReturnCode.TASK_ABORTED
    assert executor._trainer is None


def test_bad_executor_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty command"):
        ClientAPIExecutor("  ")
    with pytest.raises(ValueError, match=r"filters\[0\] must be an object with a 'path'"):
        ClientAPIExecutor("python t.py", filters=["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="task_timeout must be a non-negative"):
        ClientAPIExecutor("python t.py", task_timeout=-1)
