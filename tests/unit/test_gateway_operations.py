"""The gateway's operation calls (RunOperation, ExportOperationResult) on the in-memory bus: a
job-store that counts its GetJob calls and a server job that answers, both handlers of this test.
A running job's record serves its operations for `operating_record_s`, every caller still
authorised on every call; a job that ended meanwhile is refused with its status all the same."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from google.protobuf.message import Message

from fedhive.auth import Admin
from fedhive.auth.policy import Role
from fedhive.blobs import LocalBlobStore
from fedhive.bus import Delivery, MemoryBroker, MemoryBus
from fedhive.errors import FailedPrecondition, PermissionDenied
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, operation_pb2
from fedhive_services.gateway.handlers import JOB_STORE, Gateway, GatewayConfig

NAMES = Names("t")
JOB = "0f6c1a2e-5b7d-4c3e-9a8b-1d2e3f4a5b6c"
OWNER = Admin("lead@a", "a", Role.LEAD)


@dataclass
class System:
    gateway: Gateway
    bus: MemoryBus
    status: JobStatus = JobStatus.RUNNING
    reads: int = 0
    operations: list[str] = field(default_factory=list)

    def job_store(self, message: Message, delivery: Delivery) -> job_pb2.JobRecord:
        assert isinstance(message, admin_pb2.GetJobRequest) and message.job_id == JOB
        self.reads += 1
        return job_pb2.JobRecord(
            job_id=JOB, status=status_to_proto(self.status),
            submitter=job_pb2.Submitter(name=OWNER.name, org=OWNER.org, role=OWNER.role),
            history=[job_pb2.StatusChange(reason="ended by the test")])

    def server_job(self, message: Message, delivery: Delivery) -> Any:
        assert isinstance(message, operation_pb2.OperationRequest)
        self.operations.append(message.op_id)
        if message.op_id == "lost":  # taken as its server job stopped: answered too late
            self.status = JobStatus.FINISHED_COMPLETED
            time.sleep(0.5)
        return operation_pb2.OperationReply(state=operation_pb2.OperationReply.STATE_DONE)

    def operate(self, admin: Admin = OWNER, op_id: str = "op") -> operation_pb2.OperationReply:
        return self.gateway.run_operation(
            admin, operation_pb2.OperationRequest(job_id=JOB, op_id=op_id, task_name="train"))

    def end(self) -> None:
        """The job finished: its status is final and its task queue gone (the runner's order)."""
        self.bus.delete_queue(NAMES.job_server_queue(JOB))
        self.status = JobStatus.FINISHED_COMPLETED


def start(tmp_path: Any, record_s: float, rpc_timeout: float = 30.0) -> Iterator[System]:
    broker = MemoryBroker()
    bus = MemoryBus(broker, "services", NAMES)
    store = LocalBlobStore(tmp_path / "blobs")
    config = GatewayConfig(operating_record_s=record_s, rpc_timeout=rpc_timeout)
    gateway = Gateway(bus, store, NAMES, config, structlog.get_logger())
    system = System(gateway, bus)
    bus.serve(NAMES.service_queue(JOB_STORE), system.job_store, [admin_pb2.GetJobRequest])
    bus.serve(NAMES.job_server_queue(JOB), system.server_job,
              [operation_pb2.OperationRequest], replicated=False)
    try:
        yield system
    finally:
        bus.close()
        store.close()


@pytest.fixture
def system(tmp_path: Any) -> Iterator[System]:
    yield from start(tmp_path, record_s=60)


def test_a_running_jobs_record_serves_its_next_operations(system: System) -> None:
    for number in range(3):
        assert system.operate(op_id=f"op-{number}").state == \
            operation_pb2.OperationReply.STATE_DONE
    assert system.operations == ["op-0", "op-1", "op-2"]
    assert system.reads == 1  # one job-store call for the three


def test_every_caller_is_still_authorised_on_a_reused_record(system: System) -> None:
    system.operate()
    for stranger in (Admin("lead@b", "b", Role.LEAD), Admin("member@a", "a", Role.MEMBER)):
        with pytest.raises(PermissionDenied):
            system.operate(stranger)
    assert system.operations == ["op"]


def test_a_job_that_ended_since_its_record_was_read_is_refused_with_its_status(
        system: System) -> None:
    system.operate()
    system.end()
    with pytest.raises(FailedPrecondition, match=r"FINISHED:COMPLETED .*takes no more"):
        system.operate(op_id="late")
    assert system.operations == ["op"]
    assert system.reads == 2  # read afresh once its server job was gone


def test_without_reuse_every_operation_reads_the_job(tmp_path: Any) -> None:
    for system in start(tmp_path, record_s=0):
        system.operate()
        system.operate()
        assert system.reads == 2


def test_an_operation_lost_as_the_job_ended_is_refused_with_its_status(tmp_path: Any) -> None:
    for system in start(tmp_path, record_s=60, rpc_timeout=0.2):
        system.operate()
        with pytest.raises(FailedPrecondition, match=r"FINISHED:COMPLETED .*takes no more"):
            system.operate(op_id="lost")  # not "no reply": the caller would wait and retry
        assert system.operations == ["op", "lost"]
