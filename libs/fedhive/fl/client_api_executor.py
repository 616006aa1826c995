"""`ClientAPIExecutor`: a client job's executor that runs the user's training script as a
subprocess speaking the client API (`fedhive.client`); FLARE's ClientAPILauncherExecutor.

    {"executors": [{"tasks": ["train"], "executor": {
        "path": "fedhive.fl.client_api_executor.ClientAPIExecutor",
        "args": {"command": "python custom/train.py --epochs 2", "launch_once": true,
                 "task_timeout": 0, "memory_hygiene": false,
                 "filters": [{"path": "my_filters.Clip", "args": {"limit": 1.0}}]}}}]}

* `command` is split like a shell would (shlex, no shell); a leading `python`/`python3` is this
  interpreter. It runs in the app folder (the client job's working directory) with `custom/`
  on PYTHONPATH, in the client job's process group, with the client job's environment minus
  its broker and S3 credentials, plus `FEDHIVE_CLIENT_FD` (its end of a socketpair),
  `FEDHIVE_JOB_ID`, `FEDHIVE_SITE` and `FEDHIVE_WORKSPACE`.
* `launch_once` (default): one trainer for the whole job, handed task after task (it keeps
  the tensors it downloaded). Otherwise one trainer per task, told to stop once it answered.
* The pipe carries only small messages (see proto/fedhive/v1/client.proto): the task's refs,
  forwarded exactly as the server sent them, and the trainer's result refs. The client job
  never downloads, deserialises or re-serialises tensor bytes and opens no S3 connection; it
  relays the trainer's upload grants, multipart completions and URL re-signing to the server
  job as its own RPCs.
* A trainer that dies or exits without sending fails the task with `EXECUTION_EXCEPTION` and
  one line naming the job, site, task, round and exit code (or signal); the next task starts a
  new trainer. `task_timeout` > 0 bounds how long a task may wait for the trainer's result (the
  trainer is then stopped); a trainer that never calls `init()` fails the task after
  `launch_timeout` seconds.
* Stopping (abort, END_RUN via `finalize`, the end of a per-task launch): a `stop` message
  first when the job ended normally, then SIGTERM, then SIGKILL after `stop_grace` seconds.
* `filters` (`{path, args}` objects with `process(params, direction)`) are built and run in the
  trainer, on real arrays; `memory_hygiene` makes the trainer collect and trim its memory
  after each send.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhive.blobs import inline_budget_for
from fedhive.client.pipe import (
    ENV_FD,
    ENV_JOB_ID,
    ENV_SITE,
    ENV_WORKSPACE,
    Message,
    Pipe,
    PipeClosed,
    error_reply,
)
from fedhive.config import child_environment
from fedhive.errors import FedhiveError, MalformedMessage
from fedhive.fl.dxo import Dxo, dxo_from_proto, dxo_to_proto
from fedhive.fl.executor import ExecTask, ServerChannel, TaskError
from fedhive.fl.result_packer import is_content_ref
from fedhive.fl.tasks import ReturnCode
from fedhive.proto.v1 import client_pb2, common_pb2, task_pb2
from fedhive.structs import dict_to_struct

POLL_S = 0.2
_SECRETS = ("FEDHIVE_AMQP_URL", "FEDHIVE_REDIS_URL", "AWS_")  # never handed to a trainer
_PYTHON = frozenset({"python", "python3", f"python3.{sys.version_info.minor}"})


class ClientAPIExecutor:
    def __init__(self, command: str, launch_once: bool = True, task_timeout: float = 0,
                 memory_hygiene: bool = False, filters: list[dict[str, Any]] | None = None,
                 launch_timeout: float = 300.0, stop_grace: float = 3.0) -> None:
        argv = shlex.split(command) if isinstance(command, str) else []
        if not argv:
            raise ValueError("'command' must be a non-empty command line")
        if argv[0] in _PYTHON:
            argv[0] = sys.executable
        for index, spec in enumerate(filters or []):
            if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
                raise ValueError(f"filters[{index}] must be an object with a 'path'")
        for name, value in (("task_timeout", task_timeout), ("launch_timeout", launch_timeout),
                            ("stop_grace", stop_grace)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds")
        self.argv = argv
        self.launch_once = launch_once
        self.task_timeout = float(task_timeout)
        self.memory_hygiene = memory_hygiene
        self.filters = list(filters or [])
        self.launch_timeout = float(launch_timeout)
        self.stop_grace = float(stop_grace)
        self._trainer: _Trainer | None = None
        self._stopping: list[threading.Thread] = []  # per-task trainers being stopped
        self._lock = threading.Lock()
        self.launches = 0  # trainers started so far

    # Executor -----------------------------------------------------------------------------
    def execute(self, task: ExecTask) -> Dxo:
        with self._lock:
            where = _where(task)
            trainer = self._trainer
            if trainer is None or not trainer.alive():
                if trainer is not None:
                    trainer.stop(self.stop_grace, "", task.log)
                trainer = self._trainer = self._launch(task, where)
            trainer.channel = task.server
            try:
                trainer.push(client_pb2.TrainerTask(
                    task_id=task.task_id, task_name=task.name,
                    data=dxo_to_proto(task.data, _no_arrays), props=dict_to_struct(task.props),
                    timeout_ms=int(task.timeout * 1000)))
                result = self._wait(trainer, task, where)
            except _Reported:  # the trainer answered (with an error): it may go on
                if not self.launch_once:
                    self._stop_later(trainer, task)
                raise
            except BaseException:
                self._retire(trainer, task)  # dead, stuck or aborted
                raise
            if not self.launch_once:
                self._stop_later(trainer, task)
            return result

    def finalize(self) -> None:
        """The run is over (END_RUN or abort): stop the trainer."""
        with self._lock:
            trainer, self._trainer = self._trainer, None
            stopping, self._stopping = self._stopping, []
        if trainer is not None:
            trainer.stop(self.stop_grace, "the job ended", trainer.log)
        for thread in stopping:
            thread.join()

    # internals ----------------------------------------------------------------------------
    def _launch(self, task: ExecTask, where: str) -> _Trainer:
        app = task.workspace
        env = child_environment({ENV_JOB_ID: task.job_id, ENV_SITE: task.site,
                                 ENV_WORKSPACE: str(app)}, drop=_SECRETS)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(app / "custom"), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        config = client_pb2.TrainerConfig(
            job_id=task.job_id, site=task.site, workspace=str(app),
            inline_threshold=task.inline_threshold,
            inline_budget=inline_budget_for(task.inline_threshold, task.inline_budget),
            memory_hygiene=self.memory_hygiene, filters_json=json.dumps(self.filters))
        try:
            trainer = _Trainer.start(self.argv, app, env, config, task.log)
        except OSError as err:
            raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                            f"{where}: cannot start the trainer {shlex.join(self.argv)!r}: "
                            f"{err.strerror or err}") from None
        self.launches += 1
        task.log.info("client_api.trainer_started", pid=trainer.proc.pid,
                      command=shlex.join(self.argv))
        return trainer

    def _wait(self, trainer: _Trainer, task: ExecTask, where: str) -> Dxo:
        started = time.monotonic()
        while True:
            if task.abort.is_set():
                raise TaskError(ReturnCode.TASK_ABORTED, f"{where}: the client job is stopping")
            try:
                event = trainer.events.get(timeout=POLL_S)
            except queue.Empty:
                event = None
            if event is None:
                waited = time.monotonic() - started
                if self.task_timeout and waited > self.task_timeout:
                    raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                                    f"{where}: the trainer sent no result within "
                                    f"{self.task_timeout:g} s; it was stopped")
                if (not trainer.ready.is_set() and self.launch_timeout
                        and time.monotonic() - trainer.started > self.launch_timeout):
                    raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                                    f"{where}: the trainer did not call fedhive.client.init() "
                                    f"within {self.launch_timeout:g} s; it was stopped")
                if trainer.proc.poll() is None:
                    continue
                event = _Event("closed")  # exited, its end of the pipe still open elsewhere
            if event.kind == "closed":
                raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                                f"{where}: the trainer {trainer.exit_text(self.stop_grace)} "
                                "before sending a result")
            assert event.result is not None
            result = event.result
            if result.task_id != task.task_id:
                task.log.warning("client_api.stale_result", result_task_id=result.task_id)
                continue
            if result.return_code != ReturnCode.OK:
                raise _Reported(result.return_code or ReturnCode.EXECUTION_EXCEPTION,
                                f"{where}: {result.error or 'the trainer reported an error'}")
            try:
                dxo = dxo_from_proto(result.data)
            except FedhiveError as err:
                raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                                f"{where}: the trainer's result is malformed: {err}") from None
            for name, ref in dxo.data.items():  # else the worker would have to fetch it
                if not (ref.is_inline or is_content_ref(ref)):
                    raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                                    f"{where}: tensor {name!r} of the trainer's result is not "
                                    f"inline nor at a key named by its checksum ({ref.key[:200]})")
            return dxo

    def _stop_later(self, trainer: _Trainer, task: ExecTask) -> None:
        """A per-task trainer is told to stop while its result goes up."""
        self._trainer = None
        self._stopping = [thread for thread in self._stopping if thread.is_alive()]
        stopper = threading.Thread(
            target=trainer.stop, name=f"stop-trainer-{trainer.proc.pid}",
            args=(self.stop_grace, "the task is done (one trainer per task)", task.log))
        stopper.start()
        self._stopping.append(stopper)

    def _retire(self, trainer: _Trainer, task: ExecTask) -> None:
        """SIGTERM, then SIGKILL: a trainer that failed its task is not trusted with another."""
        if self._trainer is trainer:
            self._trainer = None
        trainer.stop(self.stop_grace, "", task.log)


class _Reported(TaskError):
    """The trainer's own error result."""


@dataclass(frozen=True)
class _Event:
    kind: str  # "result" | "closed"
    result: client_pb2.TrainerResult | None = None


class _Trainer:
    """One trainer process and its end of the pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: Pipe,
                 config: client_pb2.TrainerConfig, log: Any) -> None:
        self.proc = proc
        self.pipe = pipe
        self.config = config
        self.log = log.bind(trainer_pid=proc.pid)
        self.started = time.monotonic()
        self.ready = threading.Event()  # it said hello
        self.events: queue.Queue[_Event] = queue.Queue()
        self.channel: ServerChannel | None = None  # the current task's line to the server
        self._relays = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainer-relay")
        self.sent_bytes = 0  # pushed to the trainer (task messages)
        self._reader = threading.Thread(target=self._read, name=f"trainer-{proc.pid}",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, argv: list[str], app: Path, env: dict[str, str],
              config: client_pb2.TrainerConfig, log: Any) -> _Trainer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = {**env, ENV_FD: str(theirs.fileno())}
            proc = subprocess.Popen(argv, cwd=app, env=env, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, Pipe(ours), config, log)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.pipe_closed()

    def pipe_closed(self) -> bool:
        return not self._reader.is_alive()

    def push(self, task: client_pb2.TrainerTask) -> None:
        message = Message(task=task)
        self.sent_bytes += message.ByteSize()
        try:
            self.pipe.send(message)
        except FedhiveError:
            self.events.put(_Event("closed"))

    def stop(self, grace: float, reason: str, log: Any) -> None:
        """A stop message when there is a `reason` (a clean end), then SIGTERM, then SIGKILL."""
        if reason and self.proc.poll() is None:
            try:
                self.pipe.send(Message(stop=client_pb2.TrainerStop(reason=reason)))
                self.proc.wait(grace)
            except (FedhiveError, subprocess.TimeoutExpired):
                pass
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(signum)
            try:
                self.proc.wait(grace if signum == signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                log.warning("client_api.trainer_ignored_sigterm", pid=self.proc.pid)
        self.pipe.close()
        self._relays.shutdown(wait=False, cancel_futures=True)
        log.info("client_api.trainer_stopped", pid=self.proc.pid,
                 exit_code=self.proc.returncode, reason=reason or "stopped")

    def exit_text(self, grace: float) -> str:
        """"exited with code 3" / "was killed by signal SIGKILL" (waiting up to `grace` for the
        process to end; a process still running is killed)."""
        try:
            code = self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "closed its pipe (it was killed)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"was killed by signal {name}"
        return f"exited with code {code}"

    # the reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self.pipe.recv()
                if message is None:
                    break
                self._dispatch(message)
        except PipeClosed as err:  # e.g. reset: it exited with a task it never read
            self.log.info("client_api.pipe_closed", error=str(err))
        except FedhiveError as err:
            self.log.warning("client_api.pipe_failed", error=str(err))
        self.events.put(_Event("closed"))

    def _dispatch(self, message: Message) -> None:
        kind = message.WhichOneof("body")
        if kind == "hello":
            self.pipe.send(Message(seq=message.seq, config=self.config))
            self.ready.set()
            self.log.info("client_api.trainer_ready", rank=message.hello.rank)
        elif kind == "result":
            self.events.put(_Event("result", message.result))
            self.pipe.send(Message(seq=message.seq, ack=common_pb2.Ack()))
        elif kind in ("grant_upload", "complete_upload", "resign"):
            self._relays.submit(self._relay, message)
        else:
            self.pipe.send(error_reply(message.seq, MalformedMessage(
                f"a trainer may not send {kind or 'an empty message'}", field="body")))

    def _relay(self, message: Message) -> None:
        """A trainer's request to the server job, made as this site's RPC."""
        channel = self.channel
        try:
            if channel is None:
                raise MalformedMessage("no task is running", field="body")
            kind = message.WhichOneof("body")
            if kind == "grant_upload":
                grant = channel.grant(list(message.grant_upload.checksums),
                                      list(message.grant_upload.sizes))
                reply = Message(seq=message.seq, upload_grant=grant)
            elif kind == "complete_upload":
                done = message.complete_upload
                channel.complete(done.key, done.upload_id, list(done.etags))
                reply = Message(seq=message.seq, ack=common_pb2.Ack())
            else:
                urls = channel.resign(list(message.resign.keys))
                reply = Message(seq=message.seq, resign_reply=task_pb2.ResignReply(urls=[
                    task_pb2.SignedUrl(key=key, url=url.url, url_expires_at_ms=url.expires_at_ms)
                    for key, url in urls.items()]))
        except Exception as err:  # the trainer gets the error, typed
            reply = error_reply(message.seq, err)
        with contextlib.suppress(FedhiveError):  # the trainer is gone: the task sees it
            self.pipe.send(reply)


def _where(task: ExecTask) -> str:
    text = f"job {task.job_id} site {task.site} task {task.name!r}"
    return text + (f" round {task.round}" if task.round is not None else "")


def _no_arrays(arrays: Any) -> list[Any]:
    raise TaskError(ReturnCode.BAD_TASK_DATA,
                    "the task data holds arrays, not refs: nothing to forward to a trainer")
