"""HubExecutor (seed 004): a hub site's client job runs it for every task of the upper tier.

Each task becomes one operation of the lower-tier job with the same id (`Hub.deploy` made it),
run through the lower tier's gateway:

1. the task's data goes down as it came: refs (the upper tier's objects, with its presigned
   URLs) reach the lower tier's trainers untouched; the hub reads no tensor bytes;
2. the operation id is the task's id, so a repeated or re-sent task never runs twice below;
3. the lower tier has `task_read_wait_time` seconds to pick the task up (its job may still be
   scheduled or starting), else the task fails with that reason and the lower-tier job is
   aborted; `task_wait_time` bounds the whole task (default: as long as the lower-tier job
   runs); the lower-tier job ending (aborted, failed, unschedulable) fails the task with its
   reason;
4. the result comes back up as refs: the operation is an `export` one (the lower tier's server
   job keeps its aggregate in files, not in its store: no one there reads it), the hub asks its
   own server job for upload grants for the result's tensors (its checksums and sizes, as any
   site does), the lower tier's server job copies the bytes into them
   (`ExportOperationResult`), the hub completes the multipart uploads and returns refs to the
   granted keys, with the weight the result stands for (NUM_STEPS_CURRENT_ROUND: the sum of
   the lower tier's) and its contributors.

When the run ends (END_RUN) the lower-tier job is ended (FINISHED:COMPLETED) and `ENDED_MARK`
is left in the client job's folder, so that the agent's clean-up (the upper tier's runner
aborts every site of a finished job) does not abort it after all; when the client job is
stopped (abort) the lower-tier job is aborted (by the agent too, when the mark is missing).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from fedhive.errors import FailedPrecondition, FedhiveError
from fedhive.fl.dxo import Dxo
from fedhive.fl.executor import ExecTask, TaskError
from fedhive.fl.tasks import ReturnCode
from fedhive.proto.v1 import operation_pb2
from fedhive.sdk import Session
from fedhive.sdk.operations import end_request, job_gone, request_for, run_until_done

from .hub import abort_lower
from .hub_config import ENDED_MARK, HubConfig


class HubExecutor:
    def __init__(self, config: HubConfig, job_id: str, abort: threading.Event,
                 folder: Path) -> None:
        self.config = config
        self.job_id = job_id
        self._abort = abort
        self._mark = folder / ENDED_MARK
        self._log = structlog.get_logger().bind(job_id=job_id, lower_tier=config.gateway)
        self._session: Session = config.session(timeout=30.0)

    def execute(self, task: ExecTask) -> Dxo:
        request = request_for(self.job_id, task.name, task.data, op_id=task.task_id or "")
        request.export = True  # its result comes up by ExportOperationResult: kept off T2's store
        log = task.log.bind(lower_tier=self.config.gateway)
        log.info("hub.task_forwarded", op_id=request.op_id, tensors=len(task.data.data))
        try:
            result = run_until_done(self._run, request,
                                    read_wait=self.config.task_read_wait_time,
                                    wait=self.config.task_wait_time, alive=self._why_ended,
                                    sleep=self._sleep)
        except FailedPrecondition as err:
            if "task_read_wait_time" in err.message:
                self._abort_below(f"the task was not picked up: {err.message}")
            raise TaskError(ReturnCode.EXECUTION_EXCEPTION,
                            f"lower tier ({self.config.gateway}): {err.message}") from None
        if self._abort.is_set():
            raise TaskError(ReturnCode.EXECUTION_EXCEPTION, "the client job is stopping")
        dxo = self._bring_up(task, request.op_id, result.dxo)
        dxo.meta["contributions"] = result.contributions
        log.info("hub.task_done", op_id=request.op_id, weight=result.weight,
                 sites=sorted(result.contributions))
        return dxo

    def finalize(self) -> None:
        """The run is over: end the lower-tier job (aborted when this client job was). The
        end, once decided, is not cut short by a stop that comes meanwhile."""
        try:
            if self._abort.is_set():
                self._abort_below("the upper tier's client job was stopped")
            elif not self._why_ended():
                run_until_done(self._session.run_operation, end_request(self.job_id),
                               read_wait=self.config.task_read_wait_time,
                               alive=self._why_ended)
                self._mark.write_text("ended\n")
        except FedhiveError:  # it ends by itself (controller_wait_time) or by the abort
            pass
        finally:
            self._session.close()

    # the lower tier -----------------------------------------------------------------------
    def _run(self, request: operation_pb2.OperationRequest) -> operation_pb2.OperationReply:
        if self._abort.is_set():
            raise FailedPrecondition("the client job is stopping", field="job_id")
        return self._session.run_operation(request)

    def _why_ended(self) -> str:
        record = self._session.get(self.job_id)
        return job_gone(record.job_id, record.status.value, record.status_reason)

    def _abort_below(self, reason: str) -> None:
        abort_lower(self._session, self.job_id, reason, self._log)

    def _sleep(self, seconds: float) -> None:
        self._abort.wait(seconds)

    def _bring_up(self, task: ExecTask, op_id: str, lower: Dxo) -> Dxo:
        """The result with every stored tensor copied into this tier (granted keys)."""
        stored = [ref for ref in lower.refs() if not ref.is_inline]
        if not stored:
            return lower
        if task.server is None:
            raise TaskError(ReturnCode.EXECUTION_EXCEPTION, "no channel to the server job")
        grant = task.server.grant([ref.checksum for ref in stored],
                                  [ref.length for ref in stored])
        export = operation_pb2.ExportRequest(job_id=self.job_id, op_id=op_id)
        multipart: list[tuple[str, str]] = []
        for ref, target in zip(stored, grant.targets, strict=True):
            if target.present:
                continue
            export.targets.add(name=ref.name, url=target.url, write_once=target.write_once,
                               part_size=target.part_size, part_urls=list(target.part_urls))
            if target.part_urls:
                multipart.append((target.key, target.upload_id))
        if export.targets:
            reply = self._session.export_operation(export)
            etags = [list(parts.etags) for parts, target in zip(reply.targets, export.targets,
                                                                strict=True) if target.part_urls]
            for (key, upload_id), tags in zip(multipart, etags, strict=True):
                task.server.complete(key, upload_id, tags)
        data: dict[str, Any] = dict(lower.data)
        for ref, target in zip(stored, grant.targets, strict=True):
            data[ref.name] = replace(ref, key=target.key, url="", url_expires_at_ms=0, offset=0)
        return Dxo(lower.data_kind, data, dict(lower.meta))

