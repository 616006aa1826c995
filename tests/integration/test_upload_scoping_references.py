"""What uploads a site's result, the server's models and other sites may name and read (issue
#16 point 2), on real S3: a result names only the server's objects, the site's own uploads or
what its task handed it (a relay); the global model, a checkpoint and the model file name the
server's objects only; a site gets URLs only for what it was handed or uploaded; a failing
upload names the site that made it.

The job, its sites and how they act: tests/fixtures/uploads.py. A misbehaving site asks for
URLs of keys it learnt. The grants and writes themselves: test_upload_scoping.py.
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedhive.blobs import BlobStore, TensorKind, TensorRef, content_key
from fedhive.blobs.keys import checkpoint_copy_key, parse_upload_key, upload_key, upload_prefix
from fedhive.errors import BlobNotFound, ChecksumMismatch, PermissionDenied
from fedhive.fl.checkpoint import Checkpoint, checkpoint_keys, load_checkpoint, save_checkpoint
from fedhive.fl.dxo import DataKind, Dxo, dxo_from_proto
from fedhive.fl.executor import ExecTask
from fedhive.fl.model_store import ModelStore
from fedhive.fl.persistors import NumpyModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.workflows import Cyclic
from fedhive.proto.v1 import task_pb2
from tests.fixtures.uploads import JUNK, Job, N, Site, checksum_of, full
from tests.fixtures.uploads import job as job

_A = task_pb2.TaskAssignment


def test_a_result_names_only_server_objects_its_own_uploads_or_what_it_was_handed(
        job: Job) -> None:
    a, b = job.sites["a"], job.sites["b"]
    first = job.send({"w": full(0)}, a)
    a.load(a.next_task())
    trained = full(3)
    assert a.send(Dxo(DataKind.WEIGHTS, {"w": trained})).accepted
    a_ref = job.result_of(first, a).data["w"]
    assert isinstance(a_ref, TensorRef)
    assert a_ref.key.startswith(upload_prefix(job.prefix, a.name))

    # b was never handed a's upload: it may not name it (it is a's, private to a)
    job.send({"w": full(0)}, b)
    b.next_task()
    reply = b.submit(b.result(a_ref))
    assert not reply.accepted
    assert reply.reason.startswith(f"result data rejected: job {job.ctx.job_id} site {b.name} "
                                   "task 'train' round 0: tensor 'w': key")
    assert reply.reason.endswith("nor one its task handed it")

    # a relay (the cyclic workflow): a's result is b's task data; b may send it back as is
    relay = job.send(job.result_of(first, a), b)
    handed = b.next_task()
    assert handed.data.tensors[0].key == a_ref.key and handed.data.tensors[0].url
    np.testing.assert_array_equal(b.load(handed).data["w"], trained)
    assert b.send(Dxo(DataKind.WEIGHTS, {"w": a_ref})).accepted
    assert b.uploader.bytes_sent == 0
    assert job.result_of(relay, b).data["w"].key == a_ref.key


def test_a_checkpoint_names_no_site_upload(job: Job) -> None:
    """A caller checkpoints a site's result as it came, uploads of that site: the checkpoint
    names the server's object of an unchanged tensor and a copy of its own of the others, so
    the site's objects changing later (in a store that did not honour their write-once URLs:
    written here with credentials) changes nothing; a copy that cannot be read names the site;
    the next checkpoint deletes the copies the last one made."""
    a, b = job.sites["a"], job.sites["b"]
    frozen = np.arange(N, dtype=np.float32)
    task = job.send({"frozen": frozen, "w": full(0)})
    for site, value in ((a, 1.0), (b, 2.0)):
        loaded = site.load(site.next_task())
        assert site.send(Dxo(DataKind.WEIGHTS, {"frozen": loaded.data["frozen"],
                                                "w": full(value)})).accepted
    a_result, b_result = job.result_of(task, a), job.result_of(task, b)

    save_checkpoint(job.ctx, Checkpoint("Cyclic", 0, 2, a_result))
    named = checkpoint_keys(job.ctx)
    copy = checkpoint_copy_key(job.prefix, checksum_of(full(1)))
    assert named == {content_key(job.prefix, checksum_of(frozen)), copy}
    job.store.put(a_result.data["w"].key, JUNK)
    checkpoint = load_checkpoint(job.ctx, job.ctx.job_id)
    assert checkpoint is not None
    back = checkpoint.model.materialized(job.store).data
    np.testing.assert_array_equal(back["w"], full(1))
    np.testing.assert_array_equal(back["frozen"], frozen)

    job.store.put(b_result.data["w"].key, JUNK)
    with pytest.raises(ChecksumMismatch, match=f"\\(uploaded by site {b.name}\\)$"):
        save_checkpoint(job.ctx, Checkpoint("Cyclic", 1, 2, b_result))
    assert checkpoint_keys(job.ctx) == named  # the last good checkpoint stands
    save_checkpoint(job.ctx, Checkpoint("Cyclic", 1, 2, Dxo(DataKind.WEIGHTS, {
        "frozen": b_result.data["frozen"]})))
    assert not job.store.exists(copy)


def test_the_cyclic_relay_forwards_uploads_and_the_global_model_names_no_site_key(
        job: Job) -> None:
    """The real Cyclic workflow over the task server: a trains "w", b sends back what a sent
    (a relay of a's uploads within the round, unread by the server). Each round's global
    model, which the next round starts from, the checkpoint and the model file hold the
    server's objects only, and once the job is done only the checkpoint's objects are left."""
    a, b = job.sites["a"], job.sites["b"]
    job.ctx.components.update({
        "persistor": NumpyModelPersistor(initial={"frozen": list(range(N)), "w": [0.0] * N}),
        "shareable_generator": FullModelShareableGenerator()})
    handed: dict[str, list[str]] = {a.name: [], b.name: []}  # the keys of "w" each site got

    def train(site: Site, data: Dxo) -> Dxo:
        handed[site.name].append(data.data["w"].key)
        w = Dxo(DataKind.WEIGHTS, {"w": data.data["w"]}).materialized(site.fetcher).data["w"]
        return Dxo(DataKind.WEIGHTS, {"frozen": data.data["frozen"], "w": w + 1})

    def relay(site: Site, data: Dxo) -> Dxo:
        handed[site.name].append(data.data["w"].key)
        return Dxo(DataKind.WEIGHTS, dict(data.data))

    threads = [threading.Thread(target=serve, args=(site, act), daemon=True)
               for site, act in ((a, train), (b, relay))]
    for thread in threads:
        thread.start()
    workflow = Cyclic(num_rounds=2)
    try:
        workflow.prepare(job.ctx)
        workflow.run(job.ctx)
    finally:
        job.tasks.end_run()
        for thread in threads:
            thread.join(timeout=15)
    assert b.uploader.bytes_sent == 0  # b relayed a's uploads and the server's "frozen"
    # a starts each round from the server's model; b is handed a's upload of that round
    assert [parse_upload_key(job.prefix, key) for key in handed[a.name]] == [None, None]
    assert [key.startswith(upload_prefix(job.prefix, a.name)) for key in handed[b.name]] == [
        True, True]
    with np.load(job.ctx.workspace / "model.npz") as saved:
        np.testing.assert_array_equal(saved["w"], full(2))
    checkpoint = load_checkpoint(job.ctx, job.ctx.job_id)
    assert checkpoint is not None and checkpoint.round_ == 1
    named = {content_key(job.prefix, checksum_of(np.arange(N, dtype=np.float32))),
             content_key(job.prefix, checksum_of(full(2)))}
    assert {ref.key for ref in checkpoint.model.refs()} == checkpoint_keys(job.ctx) == named
    assert objects(job.store, job.prefix) == named


def test_a_model_the_server_keeps_names_the_server_s_objects_only(job: Job) -> None:
    """What any workflow or custom aggregator hands the model store as the global model (here
    a site's result as it came): each upload is pointed at the server's object of its content,
    unread when there is one, else copied after its checksum is verified; an upload that is
    not what its ref says fails, naming its site."""
    a, b = job.sites["a"], job.sites["b"]
    frozen = np.arange(N, dtype=np.float32)
    task = job.send({"frozen": frozen, "w": full(0)})
    for site, value in ((a, 1.0), (b, 2.0)):
        site.next_task()
        assert site.send(Dxo(DataKind.WEIGHTS, {"frozen": frozen, "w": full(value)})).accepted
    result = job.result_of(task, a)
    assert result.data["frozen"].key == content_key(job.prefix, checksum_of(frozen))
    assert result.data["w"].key.startswith(upload_prefix(job.prefix, a.name))

    models = ModelStore.of(job.ctx)
    fetcher = CountingFetcher(job.store)
    models.store = fetcher  # type: ignore[assignment]  # the store, its reads counted
    model = models.as_refs(result)
    expected = {"frozen": content_key(job.prefix, checksum_of(frozen)),
                "w": content_key(job.prefix, checksum_of(full(1)))}
    assert {name: ref.key for name, ref in model.data.items()} == expected
    assert fetcher.read == {result.data["w"].key}  # read, verified, stored as the server's
    arrays = model.materialized(job.store).data
    np.testing.assert_array_equal(arrays["w"], full(1))
    np.testing.assert_array_equal(arrays["frozen"], frozen)
    fetcher.read.clear()
    again = models.as_refs(result)  # the server has that content now: not read again
    assert {name: ref.key for name, ref in again.data.items()} == expected
    assert fetcher.read == set()

    bad = job.result_of(task, b).data["w"]
    job.store.put(bad.key, JUNK)  # a store that did not honour the write-once URL
    with pytest.raises(ChecksumMismatch, match=f"\\(uploaded by site {b.name}\\)$"):
        models.as_refs(Dxo(DataKind.WEIGHTS, {"w": bad}))
    assert not job.store.exists(content_key(job.prefix, checksum_of(full(2))))


class CountingFetcher:
    """A blob store that records the keys it is asked to read."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self.read: set[str] = set()

    def fetch_range(self, where: Any, offset: int, dests: Any) -> None:
        self.read.add(where.key)
        self._store.fetch_range(where, offset, dests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_site_gets_urls_only_for_what_it_was_handed_or_uploaded(job: Job) -> None:
    """Re-signing: a site's result is private to it. Another site that learnt its key gets no
    URL for it, unless the server handed it that object in the data of a task still open (a
    relay); a site gets URLs for its own uploads and its open tasks' data."""
    a, b = job.sites["a"], job.sites["b"]
    first = job.send({"w": full(0)}, a)
    a.load(a.next_task())
    assert a.send(Dxo(DataKind.WEIGHTS, {"w": full(3)})).accepted
    a_key = job.result_of(first, a).data["w"].key
    assert a_key.startswith(upload_prefix(job.prefix, a.name))
    (url,) = job.server.resign(a.name, [a_key]).urls  # its own upload, its task closed
    assert (url.key, http_get(url.url)) == (a_key, full(3).tobytes())

    job.send({"w": full(1)}, b)
    (given,) = b.next_task().data.tensors  # its open task's data: b may renew its URL
    assert given.key == content_key(job.prefix, checksum_of(full(1)))
    (url,) = job.server.resign(b.name, [given.key]).urls
    assert http_get(url.url) == full(1).tobytes()
    for key in (a_key,  # another site's upload, never handed to b
                content_key(job.prefix, checksum_of(full(0))),  # a's task data, not b's
                "elsewhere/blake3/" + "0" * 64):  # not this job's at all
        with pytest.raises(PermissionDenied, match=f"site {b.name!r} nor its upload: no URL"):
            job.server.resign(b.name, [given.key, key])
    assert b.send(Dxo(DataKind.WEIGHTS, {"w": full(2)})).accepted

    # a relay: a's result is b's task data; while that task is open b may renew its URL
    relay = job.send(job.result_of(first, a), b)
    assert b.next_task().data.tensors[0].key == a_key
    (url,) = job.server.resign(b.name, [a_key]).urls
    assert http_get(url.url) == full(3).tobytes()
    assert b.send(Dxo(DataKind.WEIGHTS, {"w": job.result_of(first, a).data["w"]})).accepted
    assert job.result_of(relay, b).data["w"].key == a_key
    with pytest.raises(PermissionDenied, match="no URL"):
        job.server.resign(b.name, [a_key])


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return bytes(answer.read())


def test_an_executor_names_the_site_whose_relayed_upload_it_cannot_load(
        job: Job, tmp_path: Path) -> None:
    """Task data naming b's upload (a relay) that is not what b said, or is gone: a's
    executor fails loading it, and the error names b."""
    a, b = job.sites["a"], job.sites["b"]
    claimed = full(4)
    junk = upload_key(job.prefix, b.name, "t1", checksum_of(claimed))
    job.store.put(junk, JUNK)  # not what its key and ref say (written with credentials)
    gone = upload_key(job.prefix, b.name, "t2", checksum_of(claimed))
    for key, error, words in ((junk, ChecksumMismatch, "do not match"),
                              (gone, BlobNotFound, "not found")):
        ref = TensorRef(name="w", dtype="float32", shape=(N,), kind=TensorKind.NUMPY, key=key,
                        length=claimed.nbytes, checksum=checksum_of(claimed),
                        url=job.store.presign_get(key, 60).url)
        task = ExecTask(name="train", data=Dxo(DataKind.WEIGHTS, {"w": ref}), props={},
                        job_id=job.ctx.job_id, site=a.name, workspace=tmp_path,
                        abort=threading.Event(), log=job.ctx.log, fetcher=a.fetcher)
        with pytest.raises(error, match=f"{words}.*\\(uploaded by site {b.name}\\)$"):
            task.load()


def serve(site: Site, act: Any) -> None:
    """A site's client job loop: each task's data (refs) to `act`, its result sent."""
    while True:
        assignment = site.poll(200)
        if assignment.kind == _A.KIND_END_RUN:
            return
        if assignment.kind == _A.KIND_TASK:
            site.task_id = assignment.task_id
            reply = site.send(act(site, dxo_from_proto(assignment.data)))
            assert reply.accepted, reply.reason


def objects(store: BlobStore, prefix: str) -> set[str]:
    client = store._client  # type: ignore[attr-defined]  # listing is not part of the port
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}
