"""The job-store as a real process on real RabbitMQ, Redis and S3: RPCs, events, redelivery
by message id, and a kill -9 in the middle of a stream of submissions."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request

import pytest
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.bus import Delivery, RabbitBus
from fedhive.config import Settings
from fedhive.errors import FailedPrecondition, InvalidArgument, NotFound
from fedhive.jobs.serde import event_from_proto, status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.state import RedisStateStore
from fedhive_services.job_store.context import job_id_for
from tests.fixtures.infra import wait_for
from tests.fixtures.job_store import (
    JobStoreProcess,
    invalid_job_zip,
    job_zip,
    service_env,
    stage,
)

ALICE = job_pb2.Submitter(name="alice", org="org-a", role="lead")
TIMEOUT = 30.0


def _call(bus: RabbitBus, service: JobStoreProcess, request: Message, reply_type: type) -> object:
    return bus.call(service.queue, request, reply_type, timeout=TIMEOUT)


def test_rpcs_and_events_end_to_end(
    job_store_process: JobStoreProcess,
    job_store_client: RabbitBus,
    job_store_blobs: S3BlobStore,
    settings: Settings,
) -> None:
    names = Names(settings.namespace)
    bus, service = job_store_client, job_store_process
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def on_event(message: Message, delivery: Delivery) -> None:
        event = event_from_proto(message)  # type: ignore[arg-type]
        with lock:
            events.append((event.job_id, delivery.routing_key))

    bus.subscribe("watcher", ["job.status.*"], on_event, [job_pb2.JobStatusEvent])

    staging = stage(job_store_blobs, names, job_zip("mnist"))
    submitted = _call(bus, service,
                      jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE),
                      admin_pb2.SubmitJobReply)
    assert isinstance(submitted, admin_pb2.SubmitJobReply)
    job_id = submitted.job_id
    wait_for(lambda: (job_id, "job.status.SUBMITTED") in events, what="the SUBMITTED event")
    assert not job_store_blobs.exists(staging)

    record = _call(bus, service, admin_pb2.GetJobRequest(job_id=job_id), job_pb2.JobRecord)
    assert isinstance(record, job_pb2.JobRecord) and record.meta.name == "mnist"
    listed = _call(bus, service, admin_pb2.ListJobsRequest(), admin_pb2.ListJobsReply)
    assert isinstance(listed, admin_pb2.ListJobsReply)
    assert [job.job_id for job in listed.jobs] == [job_id]

    cloned = _call(bus, service, jobstore_pb2.StoreCloneJob(job_id=job_id, submitter=ALICE),
                   admin_pb2.SubmitJobReply)
    assert isinstance(cloned, admin_pb2.SubmitJobReply)
    aborted = _call(bus, service, admin_pb2.AbortJobRequest(job_id=cloned.job_id),
                    job_pb2.JobRecord)
    assert isinstance(aborted, job_pb2.JobRecord)
    assert aborted.status == status_to_proto(JobStatus.FINISHED_ABORTED)
    wait_for(lambda: (cloned.job_id, "job.status.FINISHED:ABORTED") in events,
             what="the FINISHED:ABORTED event")

    download = _call(bus, service, jobstore_pb2.StoreDownloadJob(job_id=cloned.job_id),
                     jobstore_pb2.StoreDownloadReply)
    assert isinstance(download, jobstore_pb2.StoreDownloadReply)
    with urllib.request.urlopen(download.definition_url, timeout=10) as response:
        assert response.read() == job_store_blobs.get(names.job_definition_key(job_id))

    # typed errors travel back through the bus
    with pytest.raises(FailedPrecondition, match=f"job: {job_id} .*could not be deleted"):
        _call(bus, service, admin_pb2.DeleteJobRequest(job_id=job_id), admin_pb2.DeleteJobReply)
    with pytest.raises(InvalidArgument, match="min_clients"):
        bad = stage(job_store_blobs, names, invalid_job_zip())
        _call(bus, service, jobstore_pb2.StoreSubmitJob(staging_key=bad, submitter=ALICE),
              admin_pb2.SubmitJobReply)
    _call(bus, service, admin_pb2.DeleteJobRequest(job_id=cloned.job_id),
          admin_pb2.DeleteJobReply)
    with pytest.raises(NotFound, match=f"job {cloned.job_id} not found"):
        _call(bus, service, admin_pb2.GetJobRequest(job_id=cloned.job_id), job_pb2.JobRecord)
    sites = _call(bus, service, admin_pb2.ListSitesRequest(), admin_pb2.ListSitesReply)
    assert isinstance(sites, admin_pb2.ListSitesReply) and list(sites.sites) == []


def test_the_same_message_id_twice_makes_one_job(
    job_store_process: JobStoreProcess,
    job_store_client: RabbitBus,
    job_store_blobs: S3BlobStore,
    redis_state: RedisStateStore,
    settings: Settings,
) -> None:
    """The second delivery finds the job and only re-announces it (same event message id)."""
    names = Names(settings.namespace)
    job_id = job_id_for(settings.namespace, "once")
    announced: list[str] = []
    job_store_client.subscribe(
        "watcher", ["job.status.SUBMITTED"],
        lambda message, delivery: announced.append(delivery.message_id or ""),
        [job_pb2.JobStatusEvent],
    )
    staging = stage(job_store_blobs, names, job_zip())
    request = jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE)
    for _ in range(2):
        job_store_client.send(job_store_process.queue, request, message_id="once")
    wait_for(lambda: len(announced) == 2, what="both deliveries to be handled")
    assert announced == [f"{job_id}:1", f"{job_id}:1"]
    assert redis_state.recent_job_ids() == [job_id]
    assert not job_store_blobs.exists(staging)


def test_kill_9_mid_stream_loses_no_submission(
    job_store_process: JobStoreProcess,
    job_store_client: RabbitBus,
    job_store_blobs: S3BlobStore,
    redis_state: RedisStateStore,
    settings: Settings,
) -> None:
    names = Names(settings.namespace)
    message_ids = [f"burst-{n}" for n in range(16)]
    for message_id in message_ids:
        staging = stage(job_store_blobs, names, job_zip(message_id))
        request = jobstore_pb2.StoreSubmitJob(staging_key=staging, submitter=ALICE)
        job_store_client.send(job_store_process.queue, request, message_id=message_id)
    wait_for(lambda: redis_state.recent_job_ids(), what="a first job to be stored")
    job_store_process.kill()
    stored_at_kill = len(redis_state.recent_job_ids(count=100))
    job_store_process.start()
    expected = {job_id_for(settings.namespace, m) for m in message_ids}
    wait_for(lambda: set(redis_state.recent_job_ids(count=100)) == expected, timeout=60,
             what=f"all 16 jobs (had {stored_at_kill} at the kill)")
    wait_for(lambda: _staged(job_store_blobs, names) == [], what="every staged upload to go")
    assert len(redis_state.recent_job_ids(count=100)) == 16
    names_stored = sorted(r.meta.name for r in redis_state.get_jobs(sorted(expected)))
    assert names_stored == sorted(message_ids)


def test_bad_settings_end_the_service_with_one_line(settings: Settings) -> None:
    env = service_env(settings) | {"FEDHIVE_NAMESPACE": "Not Valid!"}
    done = subprocess.run(
        [sys.executable, "-m", "fedhive_services.job_store.main"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "fedhive-job-store: FEDHIVE_NAMESPACE='Not Valid!' must be 1-40 chars of a-z, 0-9, '_' "
        "or '-', starting with a letter or digit"
    ]


def _staged(blobs: S3BlobStore, names: Names) -> list[str]:
    prefix = names.staging_key("")[: -len(".zip")]
    listed = blobs._client.list_objects_v2(Bucket=blobs.bucket, Prefix=prefix)
    return [item["Key"] for item in listed.get("Contents", [])]

