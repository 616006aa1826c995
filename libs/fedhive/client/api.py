"""The trainer's end of the client API: one `ClientAPI` per trainer process (see
`fedhive.client` for the functions users call).

It holds the pipe to the client job, a reader thread (tasks and stops pushed by the CJ go to a
queue; replies go to the request that waits for them), a `PresignedFetcher` that re-signs
expired URLs through the pipe, a `PresignedUploader`, and a `TensorCache` kept for the life of
the process: a trainer launched once per job downloads only the tensors whose content changed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fedhive.blobs import (
    PresignedFetcher,
    PresignedUploader,
    PresignedUrl,
    TensorCache,
    TensorRef,
    unpack,
)
from fedhive.blobs.keys import blame_uploader
from fedhive.client.hygiene import clean_memory
from fedhive.client.pipe import ENV_FD, Message, Pipe, PipeClosed, Requests
from fedhive.errors import FedhiveError
from fedhive.fl.components import build_component
from fedhive.fl.dxo import Dxo, dxo_from_proto
from fedhive.fl.model import FLModel
from fedhive.fl.result_packer import ResultPacker
from fedhive.fl.tasks import ReturnCode
from fedhive.proto.v1 import client_pb2, task_pb2

log = logging.getLogger("fedhive.client")
_STOP = None  # the task queue's end marker


class ClientAPI:
    def __init__(self, sock: socket.socket, rank: str) -> None:
        self.rank = rank
        self._pipe = Pipe(sock)
        self._requests = Requests(self._pipe)
        self._tasks: queue.Queue[client_pb2.TrainerTask | None] = queue.Queue()
        self.stop_reason = ""
        self._reader = threading.Thread(target=self._read, name="fedhive-client-pipe",
                                        daemon=True)
        self._reader.start()
        reply = self._requests.call(hello=client_pb2.TrainerHello(pid=os.getpid(), rank=rank))
        self.config = reply.config
        self.fetcher = PresignedFetcher(resign=self._resign)
        self.uploader = PresignedUploader()
        self.cache = TensorCache()
        self._packer = ResultPacker(self.fetcher, self.uploader,
                                    inline_threshold=self.config.inline_threshold,
                                    inline_budget=self.config.inline_budget)
        specs = json.loads(self.config.filters_json) if self.config.filters_json else []
        self._filters = [_filter(spec, index) for index, spec in enumerate(specs)]
        self.task: client_pb2.TrainerTask | None = None  # received, not yet answered
        self.model: FLModel | None = None

    # the API ------------------------------------------------------------------------------
    def receive(self, timeout: float | None = None) -> FLModel | None:
        """The current task's model (the same one until `send`); None once the client job said
        stop or went away, or after `timeout` seconds without a task."""
        if self.model is not None:
            return self.model
        try:
            task = self._tasks.get(timeout=timeout)
        except queue.Empty:
            return None
        if task is _STOP:
            self._tasks.put(_STOP)  # every later call sees the end too
            return None
        try:
            model = self._load(task)
        except Exception as err:
            self._answer_failure(task, ReturnCode.BAD_TASK_DATA,
                                 f"the trainer could not load the task data: {_one_line(err)}")
            raise
        self.task, self.model = task, model
        return model

    def send(self, model: FLModel, clear_cache: bool = True) -> None:
        if not isinstance(model, FLModel):
            raise TypeError(f"expected an FLModel to send, got {type(model).__name__}")
        task = self.task
        if task is None:
            raise RuntimeError('"receive" needs to be called before sending model!')
        try:
            dxo = model.to_dxo()
            dxo.data = self._run_filters(dxo.data, "out")
            result = client_pb2.TrainerResult(task_id=task.task_id, return_code=ReturnCode.OK)
            self._packer.pack(dxo, _PipeChannel(self._requests, task.task_id), into=result.data)
        except Exception as err:
            self._answer_failure(task, ReturnCode.EXECUTION_EXCEPTION,
                                 f"the trainer's result could not be sent: {_one_line(err)}")
            raise
        self._requests.call(result=result)
        if clear_cache:
            self.task, self.model = None, None
        del dxo, result
        if self.config.memory_hygiene:
            clean_memory()

    def is_running(self) -> bool:
        return self.receive() is not None

    @property
    def task_name(self) -> str:
        return self.task.task_name if self.task is not None else ""

    def close(self) -> None:
        self._pipe.close()
        self.fetcher.close()
        self.uploader.close()

    # failures in the trainer ----------------------------------------------------------------
    def excepthook(self, previous: Callable[..., Any]) -> Callable[..., Any]:
        """A sys.excepthook that first reports an uncaught error as the current task's result
        (so the task fails with the error's line, not only an exit code)."""

        def hook(kind: type[BaseException], err: BaseException,
                 trace: TracebackType | None) -> None:
            task = self.task
            if task is not None and not isinstance(err, KeyboardInterrupt):
                self._answer_failure(task, ReturnCode.EXECUTION_EXCEPTION,
                                     f"the trainer raised {_one_line(err)}")
            previous(kind, err, trace)

        return hook

    def _answer_failure(self, task: client_pb2.TrainerTask, code: str, error: str) -> None:
        self.task, self.model = None, None
        try:
            self._requests.call(timeout=30, result=client_pb2.TrainerResult(
                task_id=task.task_id, return_code=code, error=error))
        except (FedhiveError, TimeoutError) as err:
            log.warning("could not report the failure of task %s: %s", task.task_id, err)

    # internals ----------------------------------------------------------------------------
    def _load(self, task: client_pb2.TrainerTask) -> FLModel:
        dxo = dxo_from_proto(task.data)
        refs = dxo.refs()
        try:
            arrays = unpack(refs, self.fetcher, cache=self.cache) if refs else {}
        except FedhiveError as err:  # a site's upload relayed to this one: blame that site
            blamed = blame_uploader(err, refs)
            if blamed is None:
                raise
            raise blamed from err
        data = {name: arrays.get(name, value) if isinstance(value, TensorRef) else value
                for name, value in dxo.data.items()}
        data = self._run_filters(data, "in")
        return FLModel.from_dxo(Dxo(dxo.data_kind, data, dxo.meta))

    def _run_filters(self, params: dict[str, Any], direction: str) -> dict[str, Any]:
        for item in self._filters:
            params = item.process(params, direction)
            if not isinstance(params, dict):
                raise TypeError(f"filter {type(item).__name__}.process returned a "
                                f"{type(params).__name__}, not a dict")
        return params

    def _resign(self, keys: list[str]) -> dict[str, PresignedUrl]:
        reply = self._requests.call(resign=task_pb2.ResignRequest(keys=keys)).resign_reply
        return {url.key: PresignedUrl(url.url, url.url_expires_at_ms) for url in reply.urls}

    def _read(self) -> None:
        reason: BaseException = PipeClosed("the client job closed the pipe", field="pipe")
        try:
            while True:
                message = self._pipe.recv()
                if message is None:
                    break
                self._dispatch(message)
        except FedhiveError as err:
            reason = err
        self.stop_reason = self.stop_reason or str(reason)
        self._requests.fail_all(reason)
        self._tasks.put(_STOP)

    def _dispatch(self, message: Message) -> None:
        kind = message.WhichOneof("body")
        if kind == "task":
            self._tasks.put(message.task)
        elif kind == "stop":
            self.stop_reason = message.stop.reason or "stopped by the client job"
            self._tasks.put(_STOP)
        elif message.seq and not self._requests.answer(message):
            log.warning("reply %s to no request", message.seq)


class _PipeChannel:
    """The trainer's `UploadChannel`: the CJ relays each request to the server job."""

    def __init__(self, requests: Requests, task_id: str) -> None:
        self._requests = requests
        self._task_id = task_id

    def grant(self, checksums: list[str], sizes: list[int]) -> task_pb2.UploadGrant:
        request = task_pb2.GrantUploadRequest(task_id=self._task_id, checksums=checksums,
                                              sizes=sizes)
        return self._requests.call(grant_upload=request).upload_grant

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        request = task_pb2.CompleteUploadRequest(key=key, upload_id=upload_id, etags=etags)
        self._requests.call(complete_upload=request)


def connect(rank: str) -> ClientAPI:
    """The ClientAPI over the pipe the client job handed this process (`FEDHIVE_CLIENT_FD`)."""
    raw = os.environ.get(ENV_FD, "")
    if not raw.isdigit():
        raise RuntimeError(f"{ENV_FD} is not set: this process was not launched by a fedhive "
                           "client job (ClientAPIExecutor)")
    try:
        sock = socket.socket(fileno=int(raw))
    except OSError as err:
        raise RuntimeError(f"{ENV_FD}={raw} is not an open socket: {err}") from None
    api = ClientAPI(sock, rank)
    sys.excepthook = api.excepthook(sys.excepthook)
    return api


def _filter(spec: Any, index: int) -> Any:
    built = build_component(spec, f"filters[{index}]", {})
    if not callable(getattr(built, "process", None)):
        raise TypeError(f"filters[{index}]: {type(built).__name__} has no "
                        "process(params, direction) method")
    return built


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:1000]
