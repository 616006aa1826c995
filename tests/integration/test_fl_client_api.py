"""The client API end to end: server job -> client job -> trainer -> client job -> server job,
on the real broker and S3, with real processes.

The server side is the real `TaskServer` + `TaskManager` (as in test_fl_transport.py). Each
site is a real client job process (`fedhive_services.site_agent.client_job`, run under
tests/integration/client_api_probe.py, which records what it sends through the trainer's pipe
and every connection it opens), connected as the site's own broker user and holding no S3 or
Redis credentials. Its `ClientAPIExecutor` launches tests/integration/client_api_trainer.py
(copied into the app's custom/) as the trainer, which uses `fedhive.client`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

from fedhive.blobs import (
    WRITE_ONCE_HEADERS,
    BlobLocation,
    PresignedFetcher,
    PresignedUploader,
    TensorKind,
    TensorRef,
    ref_to_proto,
)
from fedhive.blobs.checksum import digest
from fedhive.blobs.keys import upload_key
from fedhive.config import Settings
from fedhive.errors import BlobAccessDenied, PermissionDenied
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.tasks import CompletionStatus, ReturnCode, Task
from fedhive.proto.v1 import common_pb2, task_pb2
from tests.fixtures.client_api import Harness, MiB
from tests.fixtures.client_api import harness as harness
from tests.fixtures.infra import RUN_ID, wait_for
from tests.fixtures.task_transport import THRESHOLD, KiB
from tests.fixtures.task_transport import site_settings as site_settings


@pytest.fixture(scope="module")
def namespace() -> str:
    return f"t{RUN_ID}-fca"


def raw(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return bytes(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return bytes(np.ascontiguousarray(value).tobytes())


def doubled(value: Any) -> Any:
    return ~value if value.dtype in (np.bool_, torch.bool) else value * 2


def mixed_model() -> dict[str, Any]:
    """numpy and torch, float32, float16, bfloat16, int64 and bool, inline and through S3."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    return {
        "np_f32": rng.standard_normal(300_000).astype(np.float32),  # 1.2 MB: S3
        "np_f16": rng.standard_normal((200, 300)).astype(np.float16),  # 120 KB: S3
        "np_i64": rng.integers(-2**40, 2**40, 20_000, dtype=np.int64),  # 160 KB: S3
        "np_bool": rng.random(100_000) > 0.5,  # 100 KB: S3
        "np_f32_small": np.arange(16, dtype=np.float32),  # inline
        "np_bool_small": np.array([True, False, True]),  # inline
        "pt_bf16": torch.randn(256, 512, generator=gen).to(torch.bfloat16),  # 256 KB: S3
        "pt_f32": torch.randn(100_000, generator=gen),  # 400 KB: S3
        "pt_f16": torch.randn(8, 8, generator=gen).to(torch.float16),  # inline
        "pt_i64": torch.randint(-2**40, 2**40, (10_000,), generator=gen),  # 80 KB: S3
        "pt_bool": torch.rand(100_000, generator=gen) > 0.5,  # 100 KB: S3
        "pt_bf16_small": torch.randn(4, generator=gen).to(torch.bfloat16),  # inline
    }


def result_of(task: Task) -> Any:
    client_task = task.client_tasks[0]
    assert client_task.result is not None
    return client_task.result


def s3_port(settings: Settings) -> int:
    assert settings.s3_endpoint_url is not None
    port = urlsplit(settings.s3_endpoint_url).port
    assert port is not None
    return port


def test_round_trip_is_bit_exact_and_the_client_job_only_relays_refs(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    cj = h.start_client_job()
    model = mixed_model()
    task = h.run_task(model, {MetaKey.CURRENT_ROUND: 0})

    assert task.completion_status is CompletionStatus.OK
    result = result_of(task)
    assert result.ok, result.error
    assert result.dxo is not None and result.dxo.is_lazy
    prefix = h.job.ctx.tensor_prefix
    site, task_id = task.client_tasks[0].site, task.client_tasks[0].id
    for name, ref in result.dxo.data.items():
        assert isinstance(ref, TensorRef) and ref.url == ""
        if not ref.is_inline:  # uploaded by the trainer, to the site's own key for the task
            assert ref.key == upload_key(prefix, site, task_id, ref.checksum), name
    arrays = result.dxo.materialized(h.job.store).data
    calls = arrays.pop("filter_calls")  # the site filter ran in the trainer, once each way
    assert calls.tolist() == [1, 1]
    assert set(arrays) == set(model)
    for name, value in model.items():
        back = arrays[name]
        assert type(back) is type(value), name  # numpy stays numpy, torch stays torch
        assert (back.dtype, tuple(back.shape)) == (value.dtype, tuple(value.shape)), name
        assert raw(back) == raw(doubled(value)), name
    metrics = result.dxo.meta[MetaKey.METRICS]
    assert (metrics["site"], metrics["job_id"], metrics["task"]) == (
        h.job.site("a"), h.job.ctx.job_id, "train")
    assert result.dxo.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 1

    # What the client job passed to the trainer: the server's refs, unchanged (S3 ones with
    # their presigned URL), in one small message; what it passed back: refs with no URL.
    stored = sum(value.nbytes if isinstance(value, np.ndarray)
                 else value.numel() * value.element_size() for value in model.values())
    (sent,) = cj.frames("to_trainer", "task")
    assert {r["name"] for r in sent["refs"]} == set(model)
    assert all(r["inline"] or (r["key"].startswith(prefix) and r["url"]) for r in sent["refs"])
    assert all(r["inline_bytes"] <= THRESHOLD for r in sent["refs"])
    assert sent["bytes"] < 8 * THRESHOLD + 16 * KiB < stored / 2
    (back_refs,) = cj.frames("from_trainer", "result")
    assert all(r["inline"] or (r["key"].startswith(prefix) and not r["url"])
               for r in back_refs["refs"])
    assert max(f["bytes"] for f in cj.records("frame")) < 8 * THRESHOLD + 16 * KiB
    # ... and it never made an S3 client nor connected to S3
    assert cj.records("s3_client") == []
    connects = cj.records("connect")
    assert connects, "the probe saw no connection at all"
    assert all(c["address"][1] != s3_port(h.settings) for c in connects), connects

    # Round 2 on the same trainer (launched once per job): the same model again, echoed. The
    # trainer reuses every tensor it holds (nothing downloaded), and uploads nothing: S3 has
    # every object of the result already.
    first_pid, fetched = metrics["pid"], metrics["bytes_fetched"]
    assert metrics["bytes_reused"] == 0 and fetched > 0
    grants = h.store.calls["presign_put"] + h.store.calls["presign_multipart"]
    echo = h.run_task(model, {MetaKey.CURRENT_ROUND: 1, "behaviour": "echo"})
    result = result_of(echo)
    assert result.ok, result.error
    metrics = result.dxo.meta[MetaKey.METRICS]
    assert metrics["pid"] == first_pid
    assert metrics["bytes_fetched"] == fetched and metrics["bytes_reused"] == fetched
    assert h.store.calls["presign_put"] + h.store.calls["presign_multipart"] == grants
    arrays = result.dxo.materialized(h.job.store).data
    assert all(raw(arrays[name]) == raw(value) for name, value in model.items())

    # END_RUN: the client job stops its trainer and exits 0
    h.job.tasks.end_run()
    assert cj.proc.wait(timeout=30) == 0, cj.log.read_text()[-3000:]
    wait_for(lambda: not Path(f"/proc/{first_pid}").exists(), timeout=10,
             what="the trainer to be gone")


def test_an_expired_url_is_resigned_through_the_server_and_the_round_succeeds(
    harness: Callable[..., Harness], presigned_fetcher: PresignedFetcher,
) -> None:
    h = harness()
    model = {"w": np.arange(100_000, dtype=np.float32), "b": np.ones(4, np.float32)}
    refs = {ref.name: ref for ref in h.job.ctx.codec.pack(model, h.job.ctx.tensor_prefix)}
    big = refs["w"]
    short = h.job.store.presign_get(big.key, expires_in=1)

    def denied() -> bool:
        try:
            presigned_fetcher.fetch_range(BlobLocation(big.key, short.url), 0,
                                          [memoryview(bytearray(4))])
        except BlobAccessDenied:
            return True
        return False

    wait_for(denied, timeout=30, interval=0.25, what="the presigned URL to expire")
    # The ref claims a long life, so nobody renews it ahead of time: S3's 403 must be handled.
    stale = TensorRef(**{**big.__dict__, "url": short.url,
                         "url_expires_at_ms": big.url_expires_at_ms})
    h.start_client_job()
    task = h.run_task({"w": stale, "b": refs["b"]}, {MetaKey.CURRENT_ROUND: 4})
    result = result_of(task)
    assert result.ok, result.error
    assert result.dxo.meta[MetaKey.METRICS]["urls_resigned"] >= 1
    arrays = result.dxo.materialized(h.job.store).data
    assert raw(arrays["w"]) == raw(model["w"] * 2)
    assert h.store.calls["presign_get"] >= 1


def test_relayed_data_that_fails_its_checksum_is_blamed_on_the_site_that_uploaded_it(
    harness: Callable[..., Harness],
) -> None:
    """Task data naming site b's upload (the cyclic relay) whose bytes are not what b said:
    site a's trainer fails the task, and the reason names b."""
    h = harness()
    h.start_client_job()
    b = h.job.site("b")
    claimed = np.arange(50_000, dtype=np.float32)
    label = digest(claimed.view(np.uint8))
    key = upload_key(h.job.ctx.tensor_prefix, b, "t1", label)
    h.job.store.put(key, np.zeros_like(claimed).tobytes())
    ref = TensorRef(name="w", dtype="float32", shape=claimed.shape, kind=TensorKind.NUMPY,
                    key=key, length=claimed.nbytes, checksum=label)
    result = result_of(h.run_task({"w": ref}, {MetaKey.CURRENT_ROUND: 2}))
    assert result.return_code == ReturnCode.BAD_TASK_DATA
    assert result.error.startswith(
        f"job {h.job.ctx.job_id} site {h.job.site('a')} task 'train' round 2: the trainer "
        f"could not load the task data: ChecksumMismatch: tensor 'w': bytes from blob {key} ")
    assert result.error.endswith(f"(uploaded by site {b})")


def test_a_trainer_killed_mid_task_fails_the_task_clearly_and_the_next_task_restarts_it(
    harness: Callable[..., Harness],
) -> None:
    h = harness()
    h.start_client_job()
    pid_file = h.tmp / "trainer.pid"
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(8, np.float32)}, {
        "behaviour": "hang", "pid_file": str(pid_file), MetaKey.CURRENT_ROUND: 3}))
    h.job.tasks.send(task, [h.job.site("a")])
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout=60,
                       what="the trainer to start the task"))
    os.kill(pid, signal.SIGKILL)
    h.job.finish(task, 60)
    result = result_of(task)
    assert result.return_code == ReturnCode.EXECUTION_EXCEPTION
    assert result.error == (f"job {h.job.ctx.job_id} site {h.job.site('a')} task 'train' "
                            "round 3: the trainer was killed by signal SIGKILL before sending "
                            "a result")

    again = h.run_task({"w": np.ones(8, np.float32)}, {MetaKey.CURRENT_ROUND: 4})
    result = result_of(again)
    assert result.ok, result.error
    assert result.dxo.meta[MetaKey.METRICS]["pid"] != pid


@pytest.mark.parametrize(("behaviour", "error"), [
    ("exit", "the trainer exited with code 3 before sending a result"),
    ("raise", "the trainer raised ValueError: bad batch"),
])
def test_a_trainer_that_does_not_send_fails_the_task_with_a_reason(
    harness: Callable[..., Harness], behaviour: str, error: str,
) -> None:
    h = harness()
    h.start_client_job()
    task = h.run_task({"w": np.ones(8, np.float32)},
                      {"behaviour": behaviour, MetaKey.CURRENT_ROUND: 1})
    result = result_of(task)
    assert result.return_code == ReturnCode.EXECUTION_EXCEPTION
    assert result.error == (f"job {h.job.ctx.job_id} site {h.job.site('a')} task 'train' "
                            f"round 1: {error}")


def test_one_trainer_per_task_when_launch_once_is_off(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.start_client_job(launch_once=False)
    pids = []
    for round_ in range(2):
        result = result_of(h.run_task({"w": np.ones(8, np.float32)},
                                      {MetaKey.CURRENT_ROUND: round_}))
        assert result.ok, result.error
        pids.append(result.dxo.meta[MetaKey.METRICS]["pid"])
    assert pids[0] != pids[1]
    wait_for(lambda: not Path(f"/proc/{pids[1]}").exists(), timeout=15,
             what="the per-task trainer to be stopped")


def test_a_large_result_is_uploaded_multipart(harness: Callable[..., Harness]) -> None:
    h = harness(upload_part_size=5 * MiB)
    cj = h.start_client_job()
    big = np.random.default_rng(5).standard_normal(6 * MiB).astype(np.float32)  # 24 MiB
    task = h.run_task({"big": big, "small": np.ones(3, np.float32)},
                      {MetaKey.CURRENT_ROUND: 0})
    result = result_of(task)
    assert result.ok, result.error
    assert h.store.calls["presign_multipart"] == 1 and h.store.calls["complete_multipart"] == 1
    ref = result.dxo.data["big"]
    assert ref.key == upload_key(h.job.ctx.tensor_prefix, h.job.site("a"),
                                 task.client_tasks[0].id, ref.checksum)
    assert h.job.store.size(ref.key) == big.nbytes
    assert raw(result.dxo.materialized(h.job.store).data["big"]) == raw(big * 2)
    # 24 MiB went down to the trainer and 24 MiB up, none of it through the client job
    frames = cj.records("frame")
    assert frames[-1]["peak_rss_kb"] - frames[0]["peak_rss_kb"] < big.nbytes / 2 / KiB


def test_upload_grants_cannot_be_used_for_anything_else(
    harness: Callable[..., Harness],
) -> None:
    h = harness(upload_part_size=5 * MiB)
    job, a, b = h.job, h.job.site("a"), h.job.site("b")
    body = np.arange(2 * MiB, dtype=np.float32)  # 8 MiB: a multipart grant
    other = np.ones(1000, np.float32)
    sums = [digest(body.view(np.uint8)), digest(other.view(np.uint8))]
    # grants are for a task of the site awaiting its result
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(4, np.float32)},
                             {MetaKey.CURRENT_ROUND: 7}))
    job.tasks.send(task, [a])
    assignment = job.call("a", task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=a,
                                                       wait_ms=5000), task_pb2.TaskAssignment)
    with pytest.raises(PermissionDenied, match="no upload grant"):
        job.call("b", task_pb2.GrantUploadRequest(
            job_id=job.ctx.job_id, site=b, task_id=assignment.task_id, checksums=sums[1:]),
            task_pb2.UploadGrant)
    grant = job.call("a", task_pb2.GrantUploadRequest(
        job_id=job.ctx.job_id, site=a, task_id=assignment.task_id, checksums=sums,
        sizes=[body.nbytes, other.nbytes]), task_pb2.UploadGrant)
    multipart, single = grant.targets
    assert multipart.upload_id and multipart.part_size == 5 * MiB
    assert len(multipart.part_urls) == 2 and not multipart.url
    assert single.url and single.write_once and not single.upload_id

    uploader = PresignedUploader()
    try:
        # a PUT URL granted for one key does not write another
        elsewhere = single.url.replace(single.key.rsplit("/", 1)[1], "0" * 64)
        with pytest.raises(BlobAccessDenied):
            uploader.put(elsewhere, "elsewhere", other, headers=WRITE_ONCE_HEADERS)
        assert not job.store.exists(single.key.rsplit("/", 1)[0] + "/" + "0" * 64)
        with pytest.raises(BlobAccessDenied):  # the URL is signed with its write-once header
            uploader.put(single.url, single.key, other)
        uploader.put(single.url, single.key, other, headers=WRITE_ONCE_HEADERS)
        assert job.store.size(single.key) == other.nbytes
        uploader.put(single.url, single.key, body[:1000], headers=WRITE_ONCE_HEADERS)
        assert job.store.get(single.key) == other.tobytes()  # written once: not replaced
    finally:
        uploader.close()

    # completing: only the site it was granted to, only for that key and upload
    forged = task_pb2.CompleteUploadRequest(job_id=job.ctx.job_id, site=b, key=multipart.key,
                                            upload_id=multipart.upload_id, etags=["x", "y"])
    with pytest.raises(PermissionDenied, match=f"granted to site '{b}'"):
        job.call("b", forged, common_pb2.Ack)
    wrong_key = task_pb2.CompleteUploadRequest(job_id=job.ctx.job_id, site=a, key=single.key,
                                               upload_id=multipart.upload_id, etags=["x"])
    with pytest.raises(PermissionDenied, match="no multipart upload"):
        job.call("a", wrong_key, common_pb2.Ack)
    # re-signing: only keys of the site's open tasks' data, or its own uploads
    with pytest.raises(PermissionDenied, match="nor its upload: no URL"):
        job.call("a", task_pb2.ResignRequest(job_id=job.ctx.job_id, site=a,
                                             keys=["elsewhere/sha256/" + "0" * 64]),
                 task_pb2.ResignReply)

    # a result naming an upload whose object is missing: that site's task fails, with job,
    # site, task, round and tensor
    missing = TensorRef(name="w", dtype="float32", shape=(2 * MiB,), kind=TensorKind.NUMPY,
                        key=multipart.key, length=body.nbytes, checksum=sums[0])
    reply = job.call("a", task_pb2.TaskResult(
        job_id=job.ctx.job_id, site=a, task_id=assignment.task_id, task_name="train",
        return_code=ReturnCode.OK, data=task_pb2.Dxo(data_kind=task_pb2.DATA_KIND_WEIGHTS,
                                                     tensors=[ref_to_proto(missing)])),
        task_pb2.TaskResultReply)
    assert not reply.accepted
    assert reply.reason == (f"result data rejected: job {job.ctx.job_id} site {a} task 'train' "
                            f"round 7: tensor 'w': object {multipart.key} (uploaded by site {a}) "
                            "is missing")
    job.finish(task)
    assert result_of(task).return_code == ReturnCode.EXECUTION_RESULT_ERROR
    assert h.store.calls["abort_multipart"] == 1  # the task's unfinished upload: dropped


def test_a_resign_request_gives_fresh_urls(harness: Callable[..., Harness],
                                           presigned_fetcher: PresignedFetcher) -> None:
    h = harness()
    job, a, b = h.job, h.job.site("a"), h.job.site("b")
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.arange(50_000, dtype=np.int64)}))
    job.tasks.send(task, [a])
    assignment = job.call("a", task_pb2.GetTaskRequest(job_id=job.ctx.job_id, site=a,
                                                       wait_ms=5000), task_pb2.TaskAssignment)
    (ref,) = assignment.data.tensors
    # only for the site whose task's data names the object
    with pytest.raises(PermissionDenied, match=f"site {b!r} nor its upload: no URL"):
        job.call("b", task_pb2.ResignRequest(job_id=job.ctx.job_id, site=b, keys=[ref.key]),
                 task_pb2.ResignReply)
    reply = job.call("a", task_pb2.ResignRequest(job_id=job.ctx.job_id, site=a,
                                                 keys=[ref.key]), task_pb2.ResignReply)
    (signed,) = reply.urls
    assert signed.key == ref.key and signed.url and signed.url_expires_at_ms > 0
    buffer = bytearray(ref.length)
    presigned_fetcher.fetch_range(BlobLocation(ref.key, signed.url), 0, [memoryview(buffer)])
    assert bytes(buffer) == np.arange(50_000, dtype=np.int64).tobytes()



def test_stopping_the_client_job_stops_its_trainer(harness: Callable[..., Harness]) -> None:
    h = harness()
    cj = h.start_client_job()
    pid_file = h.tmp / "trainer.pid"
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": np.ones(8, np.float32)}, {
        "behaviour": "hang", "pid_file": str(pid_file)}))
    h.job.tasks.send(task, [h.job.site("a")])
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout=60,
                       what="the trainer to start the task"))
    cj.proc.send_signal(signal.SIGTERM)  # the agent's abort, to the client job alone
    assert cj.proc.wait(timeout=30) == -signal.SIGTERM
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=10,
             what="the trainer to be stopped")
