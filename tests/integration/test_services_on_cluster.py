"""The job-store and scheduler processes on the 3-node Redis Cluster (FEDHIVE_REDIS_CLUSTER=1),
with a real site agent: a job submitted through the job-store is dispatched by the scheduler,
finished, and deleted through the job-store, which leaves none of its keys on any node."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.bus import Delivery, RabbitBus
from fedhive.config import Settings
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2, runner_pb2
from fedhive.sites.heartbeat import SiteHeartbeat
from fedhive.state import RedisStateStore
from tests.fixtures.infra import stop_process, wait_for
from tests.fixtures.job_store import (
    JobStoreProcess,
    job_zip,
    running_job_store,
    service_env,
    stage,
)
from tests.fixtures.redis_servers import RedisClusterNodes

S = JobStatus
TIMEOUT = 30.0


@pytest.fixture
def cluster_job_store(cluster_settings: Settings, job_store_client: RabbitBus, tmp_path: Path,
                      broker: Any) -> Iterator[JobStoreProcess]:
    with running_job_store(cluster_settings, job_store_client,
                           tmp_path / "job-store.log") as service:
        yield service


@pytest.fixture
def cluster_scheduler(cluster_settings: Settings, tmp_path: Path,
                      broker: Any) -> Iterator[subprocess.Popen[bytes]]:
    log_path = tmp_path / "scheduler.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from fedhive_services.scheduler.main import main; main()",
             "--min-schedule-interval", "0.2", "--max-schedule-interval", "0.4",
             "--check-timeout", "5"],
            env=service_env(cluster_settings), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"scheduler exited {proc.returncode}: "
                                 f"{log_path.read_text()[-3000:]}")
        return b'"service.started"' in log_path.read_bytes()

    try:
        wait_for(ready, timeout=30, what="the scheduler to start")
        yield proc
    finally:
        stop_process(proc)


class RunnerQueue:
    """Plays the job-runner's queue: the ids of the jobs dispatched to it."""

    def __init__(self, bus: RabbitBus, names: Names) -> None:
        self.job_ids: list[str] = []
        self._lock = threading.Lock()
        bus.serve(names.service_queue("job-runner"), self._on, [runner_pb2.DispatchJob])

    def _on(self, message: Any, delivery: Delivery) -> None:
        with self._lock:
            self.job_ids.append(message.job_id)


def test_a_job_is_submitted_dispatched_and_deleted_on_the_cluster(
    site_agents: Any, cluster_state: RedisStateStore, cluster_settings: Settings,
    redis_cluster: RedisClusterNodes, make_bus: Callable[..., RabbitBus],
    job_store_client: RabbitBus, job_store_blobs: S3BlobStore,
    cluster_job_store: JobStoreProcess, cluster_scheduler: subprocess.Popen[bytes],
) -> None:
    names = Names(cluster_settings.namespace)
    runner = RunnerQueue(make_bus(name="runner-double"), names)
    site_agents.start("site-1")
    cluster_state.record_heartbeats([SiteHeartbeat("site-1", sent_at_ms=time.time_ns() // 10**6)],
                                    600)

    def call(request: Message, reply_type: type) -> Any:
        return job_store_client.call(cluster_job_store.queue, request, reply_type,
                                     timeout=TIMEOUT)

    staging = stage(job_store_blobs, names, job_zip("on-cluster", sites=("site-1",)))
    submitted = call(jobstore_pb2.StoreSubmitJob(
        staging_key=staging, submitter=job_pb2.Submitter(name="alice", role="lead")),
        admin_pb2.SubmitJobReply)
    job_id = submitted.job_id
    wait_for(lambda: job_id in runner.job_ids, timeout=30, what="the job dispatched")
    record = cluster_state.get_job(job_id)
    assert record.status is S.DISPATCHED and record.sites == ["site-1"]

    cluster_state.change_status(job_id, S.DISPATCHED, S.RUNNING, "started")
    cluster_state.change_status(job_id, S.RUNNING, S.FINISHED_COMPLETED, "done")
    call(admin_pb2.DeleteJobRequest(job_id=job_id), admin_pb2.DeleteJobReply)
    assert cluster_state.recent_job_ids() == []
    for port in redis_cluster.ports:  # what each node holds of the job
        node = redis.Redis(port=port, decode_responses=True)
        try:
            left = [key for pattern in names.redis_patterns
                    for key in node.scan_iter(match=pattern) if job_id in key]
        finally:
            node.close()
        assert left == [], port
