"""examples/hello-large end to end at small sizes, through the real services (tests/fixtures/
e2e.py): the server job's persistor generates the model and uploads it tensor by tensor, the
client jobs launch the example's trainer (`custom/train.py`, fedhive.client) once per job,
trainers download and upload straight from and to S3, the server job aggregates.

* the trained model is what the trainers computed, and tensors left frozen come back
  bit-identical; their content keys never change, so they are neither uploaded again nor
  downloaded again (the trainers' own counters);
* 50 rounds: the client jobs' and the server job's memory and the number of objects under the
  job's tensor prefix stop growing after the first rounds.
"""

from __future__ import annotations

import importlib.util
import io
import json
from types import ModuleType
from typing import Any

import numpy as np
import psutil
import pytest

from fedhive.blobs import S3BlobStore
from fedhive.jobs.status import JobStatus
from tests.fixtures.e2e import System
from tests.fixtures.hello_large import EXAMPLE, hello_large
from tests.fixtures.infra import wait_for

MiB = 1024 * 1024


def custom_module(name: str) -> ModuleType:
    """A module of the example's custom/ code (imported from its file)."""
    spec = importlib.util.spec_from_file_location(f"hello_large_{name}",
                                                  EXAMPLE / "app" / "custom" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def completed(system: System, job_id: str, timeout: float) -> Any:
    record = system.wait_final(job_id, timeout=timeout)
    assert record.status == JobStatus.FINISHED_COMPLETED, (
        f"{record.status.value}: {record.status_reason}\n{system.runner.log()}")
    return record


def test_hello_large_trains_and_keeps_frozen_tensors_bit_identical(e2e_system: System) -> None:
    system = e2e_system
    sites = system.sites[:2]
    size_mib, tensors, rounds = 16, 4, 2  # 4 MiB tensors: above the inline threshold
    job_id = system.submit(hello_large(sites=2, size_mib=size_mib, tensors=tensors,
                                       rounds=rounds, frozen_fraction=0.5))
    result = system.result(completed(system, job_id, timeout=120))

    reports = json.loads(result["metrics.json"])["rounds"]
    assert [r["round"] for r in reports] == list(range(rounds))
    assert all(set(r["metrics"]["sites"]) == set(sites) for r in reports)
    # The trainers' counters (custom/train.py): round 1 downloaded only the trained half and
    # reused the frozen half it held; round 0's upload (reported with round 1) was that half.
    half = size_mib * MiB // 2
    for site in sites:
        counted = reports[1]["metrics"]["sites"][site]
        assert counted["bytes_downloaded"] == half, (site, counted)
        assert counted["bytes_reused"] == half, (site, counted)
        assert counted["bytes_uploaded"] == half, (site, counted)
    model = np.load(io.BytesIO(result["model.npz"]))
    initial = dict(custom_module("large_model").generate(size_mib, tensors, 0))
    train = custom_module("train")
    frozen = train.frozen_names(list(initial), 0.5)
    assert len(frozen) == tensors // 2
    step = np.mean([train.site_delta(1.0, site) for site in sites])
    for name, start in initial.items():
        final = model[name]
        assert final.dtype == np.float32 and final.shape == start.shape, name
        if name in frozen:
            assert final.tobytes() == start.tobytes(), f"frozen tensor {name} changed"
        else:
            np.testing.assert_allclose(final, start + rounds * step, rtol=0, atol=1e-5)


# 50 rounds ----------------------------------------------------------------------------------
def server_job_process(system: System, job_id: str) -> psutil.Process | None:
    """The server job: the process working in the job's server workspace."""
    workspace = str(system.runner.workspace(job_id))
    for proc in psutil.process_iter(["cwd"]):
        if proc.info["cwd"] == workspace:
            return proc
    return None


def client_job_processes(system: System, job_id: str) -> list[psutil.Process] | None:
    reports = [agent.report(job_id) for agent in system.agents[:2]]
    if not all(reports):
        return None
    return [psutil.Process(report["pid"]) for report in reports if report]


def object_count(store: S3BlobStore, prefix: str) -> int:
    client = store._client  # listing is not part of the port
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix)
    return sum(page.get("KeyCount", 0) for page in pages)


def rounds_reported(system: System, job_id: str) -> int:
    path = system.runner.workspace(job_id) / "metrics.json"
    try:
        return len(json.loads(path.read_text())["rounds"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_fifty_rounds_keep_memory_and_objects_flat(e2e_system: System) -> None:
    system = e2e_system
    tensors, rounds = 2, 50
    job_id = system.submit(hello_large(sites=2, size_mib=8, tensors=tensors, rounds=rounds))
    prefix = system.names.job_tensor_prefix(job_id)
    sj = wait_for(lambda: server_job_process(system, job_id), timeout=60,
                  what="the server job")
    cjs = wait_for(lambda: client_job_processes(system, job_id), timeout=60,
                   what="the client jobs")
    samples: list[dict[str, Any]] = []  # per round seen: RSS (MiB) and objects

    def sample() -> bool:
        if system.job(job_id).status.is_final:
            return True
        seen = rounds_reported(system, job_id)
        if seen and (not samples or seen > samples[-1]["round"]):
            try:
                samples.append({"round": seen, "sj": sj.memory_info().rss / MiB,
                                "cj": max(cj.memory_info().rss for cj in cjs) / MiB,
                                "objects": object_count(system.blobs, prefix)})
            except psutil.NoSuchProcess:
                return True  # the job is ending
        return False

    wait_for(sample, timeout=180, interval=0.02, what=f"{rounds} rounds")
    completed(system, job_id, timeout=30)
    early = [s for s in samples if 5 <= s["round"] <= 15]
    late = [s for s in samples if s["round"] >= 40]
    assert early and late, f"rounds sampled: {[s['round'] for s in samples]}"
    table = [(s["round"], round(s["sj"]), round(s["cj"]), s["objects"]) for s in samples]
    # A leak of one 4 MiB tensor per round would add > 100 MiB between the two windows.
    assert max(s["cj"] for s in late) <= max(s["cj"] for s in early) + 16, table
    assert max(s["sj"] for s in late) <= max(s["sj"] for s in early) + 32, table
    # Kept at most: the global model, the next one being written, each site's result.
    assert max(s["objects"] for s in samples) <= (2 + 2) * tensors, table
    # Not growing: a sample may fall while the next model is written (a timing matter under
    # load), but the late window is not above the early one throughout.
    assert min(s["objects"] for s in late) <= max(s["objects"] for s in early), table
    kept = object_count(system.blobs, prefix)
    assert kept <= tensors, f"{kept} objects left under {prefix} after the job"
