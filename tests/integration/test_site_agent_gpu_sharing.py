"""GPU sharing by memory through the real site agent process: on a site with one (fake) 16 GiB
GPU, two jobs that each want half of it run side by side with the same CUDA_VISIBLE_DEVICES, a
third waits until one of them ends, and a restarted agent takes the memory of the jobs it
re-adopts again.

The agent builds the manager and consumer below from resources.json by import path (the
repository is on its PYTHONPATH); they are fedhive's, over a fake NVML device table."""

from __future__ import annotations

import os
import signal
from typing import Any

from fedhive.blobs import BlobStore
from fedhive.proto.v1 import site_pb2
from fedhive.resources import GPUResourceConsumer, GPUResourceManager
from fedhive.structs import dict_to_struct
from fedhive_services.site_agent import process
from tests.fixtures.infra import wait_for
from tests.fixtures.site_agent import (
    HOLDING_CJ,
    SiteAgentProcess,
    SiteAgents,
    allocate,
    deploy,
    start,
)
from tests.unit.test_resources_contract import FakeDevices


class FakeGpuManager(GPUResourceManager):
    """GPUResourceManager over `fake_gpus_GiB` (device i has that much memory) instead of NVML."""

    def __init__(self, num_of_gpus: int, mem_per_gpu_in_GiB: float,
                 fake_gpus_GiB: list[float]) -> None:
        super().__init__(num_of_gpus, mem_per_gpu_in_GiB, devices=FakeDevices(fake_gpus_GiB))


class FakeGpuConsumer(GPUResourceConsumer):
    """GPUResourceConsumer that checks `fake_gpus_GiB` (all memory free) instead of NVML."""

    def __init__(self, fake_gpus_GiB: list[float]) -> None:
        super().__init__(devices=FakeDevices(fake_gpus_GiB))


HERE = __name__
ONE_FAKE_GPU = {
    "components": [
        {"id": "resource_manager", "path": f"{HERE}.FakeGpuManager",
         "args": {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 16, "fake_gpus_GiB": [16.0]}},
        {"id": "resource_consumer", "path": f"{HERE}.FakeGpuConsumer",
         "args": {"fake_gpus_GiB": [16.0]}},
    ]
}
HALF = {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 8}


def check(agent: SiteAgentProcess, job_id: str,
          requirement: dict[str, Any]) -> site_pb2.CheckResourcesReply:
    return agent.call(site_pb2.CheckResourcesRequest(job_id=job_id,
                                                     requirement=dict_to_struct(requirement)),
                      site_pb2.CheckResourcesReply)


def running(agent: SiteAgentProcess) -> dict[str, Any]:
    return {j["job_id"]: j["allocation"] for j in agent.status()["jobs"]
            if j["state"] == "RUNNING"}


def test_two_half_gpu_jobs_run_side_by_side_on_one_gpu(
    site_agents: SiteAgents, blob_store: BlobStore
) -> None:
    agent = site_agents.start(client_job_module=HOLDING_CJ, resources=ONE_FAKE_GPU)
    for job_id in ("job-a", "job-b"):
        assert allocate(agent, job_id, HALF) == {"gpu": [0], "mem_per_gpu_in_GiB": 8}
        deploy(agent, blob_store, job_id)
        assert start(agent, job_id).state == "RUNNING"
    reports = {j: wait_for(lambda j=j: agent.report(j), what=j) for j in ("job-a", "job-b")}
    for report in reports.values():  # each client job sees the same, shared, device
        assert report["resource_env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                          "CUDA_VISIBLE_DEVICES": "0"}
    pids = {j: r["pid"] for j, r in reports.items()}
    assert all(process.alive(pid, None) for pid in pids.values())  # both at the same time
    held = {"gpu": [0], "mem_per_gpu_in_GiB": 8.0}
    assert running(agent) == {"job-a": held, "job-b": held}

    third = check(agent, "job-c", HALF)  # the GPU's memory is all taken: job-c waits
    assert not third.ok and third.reason == "num_of_gpus 1 > 0 with mem_per_gpu_in_GiB 8 free"
    shared = check(agent, "job-z", {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 0})
    assert shared.ok  # asking for no memory shares without limit
    agent.call(site_pb2.CancelResourcesRequest(token=shared.token),
               site_pb2.CancelResourcesReply)

    agent.kill()  # SIGKILL: the client jobs live on; the restarted agent re-adopts them
    agent.launch()
    assert running(agent) == {"job-a": held, "job-b": held}
    third = check(agent, "job-c", HALF)  # their memory was taken again
    assert not third.ok and third.reason == "num_of_gpus 1 > 0 with mem_per_gpu_in_GiB 8 free"

    os.killpg(pids["job-b"], signal.SIGTERM)  # job-b ends: its half comes back
    wait_for(lambda: (j := agent.job("job-b")) and j.state == "FINISHED", what="job-b FINISHED")
    assert allocate(agent, "job-c", HALF) == {"gpu": [0], "mem_per_gpu_in_GiB": 8}
    deploy(agent, blob_store, "job-c")
    start(agent, "job-c")
    report = wait_for(lambda: agent.report("job-c"), what="job-c")
    assert report["resource_env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert set(running(agent)) == {"job-a", "job-c"}
