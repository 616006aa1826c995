"""Upload grants are scoped to the site and its task (issue #16 point 2), on real S3.

The server side is the real `TaskServer` and `TaskManager` of a job of sites a and b; its
handlers are called as its consumer calls them once RabbitMQ has verified the sender (who may
send what on the broker is test_fl_transport's and test_broker_identity's). A site acts as a
client job does, with no S3 credentials: it reads its task through the presigned URLs it was
given and sends its result with the real `ResultPacker` and `PresignedUploader`, through the
server's grants. A misbehaving site uses raw HTTP with the URLs it was granted, and asks for
URLs of keys it learnt.
"""

from __future__ import annotations

import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from fedhive.blobs import (
    WRITE_ONCE_HEADERS,
    BlobStore,
    PresignedFetcher,
    PresignedUploader,
    TensorCodec,
    TensorKind,
    TensorRef,
    content_key,
    ref_to_proto,
)
from fedhive.blobs.checksum import digest
from fedhive.blobs.keys import (
    checkpoint_copy_key,
    parse_upload_key,
    upload_key,
    upload_prefix,
)
from fedhive.bus import Encoded
from fedhive.config import Settings
from fedhive.errors import (
    AlreadyExists,
    BlobNotFound,
    ChecksumMismatch,
    InvalidArgument,
    PermissionDenied,
)
from fedhive.fl.aggregators import InTimeAccumulateWeightedAggregator
from fedhive.fl.checkpoint import Checkpoint, checkpoint_keys, load_checkpoint, save_checkpoint
from fedhive.fl.dxo import DataKind, Dxo, MetaKey, dxo_from_proto
from fedhive.fl.executor import ExecTask
from fedhive.fl.model_store import ModelStore
from fedhive.fl.persistors import NumpyModelPersistor
from fedhive.fl.result_packer import ResultPacker
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.task_manager import TaskManager
from fedhive.fl.task_server import TaskServer
from fedhive.fl.tasks import ReturnCode, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows import Cyclic
from fedhive.names import Names
from fedhive.proto.v1 import task_pb2

KiB, MiB = 1024, 1024 * 1024
THRESHOLD = 4 * KiB  # arrays above it go through S3
N = 4096  # float32 elements: 16 KiB, uploaded
_A = task_pb2.TaskAssignment


@dataclass
class Site:
    """A site as its client job acts (its `UploadChannel` too), calling the server job's
    handlers directly; it keeps the PUT URLs it was granted, as a site can."""

    name: str
    server: TaskServer
    packer: ResultPacker
    fetcher: PresignedFetcher
    uploader: PresignedUploader
    task_id: str = ""
    urls: dict[str, str] = field(default_factory=dict)  # key -> a PUT URL granted for it

    def next_task(self) -> task_pb2.TaskAssignment:
        answer = self.server.get_task(self.name, 5000)
        assignment = _A.FromString(answer.body) if isinstance(answer, Encoded) else answer
        assert assignment.kind == _A.KIND_TASK, assignment
        self.task_id = assignment.task_id
        return assignment

    def load(self, assignment: task_pb2.TaskAssignment) -> Dxo:
        return dxo_from_proto(assignment.data).materialized(self.fetcher)

    def grant(self, checksums: list[str], sizes: list[int]) -> task_pb2.UploadGrant:
        grant = self.server.grant_upload(self.name, checksums, sizes, self.task_id)
        self.urls.update({target.key: target.url for target in grant.targets if target.url})
        return grant

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        self.server.complete_upload(self.name, task_pb2.CompleteUploadRequest(
            key=key, upload_id=upload_id, etags=etags))

    def send(self, dxo: Dxo) -> task_pb2.TaskResultReply:
        message = self.result()
        self.packer.pack(dxo, self, into=message.data)
        return self.submit(message)

    def result(self, *refs: TensorRef) -> task_pb2.TaskResult:
        """A result message of this site's task, naming `refs` (as a forger writes it)."""
        message = task_pb2.TaskResult(site=self.name, task_id=self.task_id, task_name="train",
                                      return_code=ReturnCode.OK)
        if refs:
            message.data.data_kind = task_pb2.DATA_KIND_WEIGHTS
            message.data.tensors.extend(ref_to_proto(ref) for ref in refs)
        return message

    def submit(self, message: task_pb2.TaskResult) -> task_pb2.TaskResultReply:
        return self.server.submit(self.name, message)


@dataclass
class Job:
    ctx: WorkflowContext
    server: TaskServer
    store: BlobStore
    sites: dict[str, Site] = field(default_factory=dict)

    @property
    def tasks(self) -> TaskManager:
        assert self.ctx.tasks is not None
        return self.ctx.tasks

    @property
    def prefix(self) -> str:
        return self.ctx.tensor_prefix

    def send(self, data: dict[str, Any] | Dxo, *sites: Site) -> Task:
        dxo = data if isinstance(data, Dxo) else Dxo(DataKind.WEIGHTS, data,
                                                      {MetaKey.CURRENT_ROUND: 0})
        task = Task("train", dxo)
        targets = [site.name for site in sites or self.sites.values()]
        self.tasks.broadcast(task, targets, min_responses=len(targets))
        return task

    def result_of(self, task: Task, site: Site) -> Dxo:
        (client_task,) = [t for t in task.client_tasks if t.site == site.name]
        result = client_task.result
        assert result is not None and result.ok and result.dxo is not None, result
        return result.dxo

    def aggregate(self, *results: tuple[Site, Dxo]) -> tuple[Dxo, dict[str, str]]:
        """The streamed weighted average of `results` (every tensor read by `aggregate`), and
        the sites whose results could not be read."""
        aggregator = InTimeAccumulateWeightedAggregator(in_time_mb=0)
        aggregator.bind(ModelStore.of(self.ctx))
        aggregator.begin_round(0)
        for site, dxo in results:
            assert aggregator.accept(site.name, dxo) == (True, "")
        return aggregator.aggregate(), aggregator.failed


@pytest.fixture
def job(settings: Settings, blob_store: BlobStore, tmp_path: Path) -> Iterator[Job]:
    job_id = f"job-{secrets.token_hex(4)}"
    names = ["site-a", "site-b"]
    log = structlog.get_logger().bind(job_id=job_id)
    codec = TensorCodec(blob_store, settings, inline_threshold=THRESHOLD)
    ctx = WorkflowContext(job_id=job_id, sites=names, workspace=tmp_path, log=log,
                          tasks=TaskManager(names, log=log), store=blob_store, codec=codec,
                          names=Names(settings.namespace))
    server = TaskServer(ctx, service_user="services", upload_part_size=5 * MiB)
    made = Job(ctx, server, blob_store)
    closing: list[Any] = [codec]
    for name in names:
        fetcher, uploader = PresignedFetcher(), PresignedUploader()
        closing += [fetcher, uploader]
        made.sites[name[-1]] = Site(name, server, ResultPacker(
            fetcher, uploader, inline_threshold=THRESHOLD), fetcher, uploader)
    yield made
    made.tasks.end_run()
    for thing in closing:
        thing.close()


def http_put(url: str, body: bytes, headers: Mapping[str, str] | None = None) -> int:
    """A raw PUT with a URL a site holds: the HTTP status S3 answered."""
    request = urllib.request.Request(url, data=body, method="PUT", headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def retarget(url: str, key: str, other: str) -> str:
    """A presigned URL with its object path changed from `key` to `other` (a forgery)."""
    assert f"/{key}?" in url
    return url.replace(f"/{key}?", f"/{other}?")


def checksum_of(array: np.ndarray) -> str:
    return digest(array.view(np.uint8))


def full(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


JUNK = full(666).tobytes()


def test_a_site_is_granted_only_its_own_keys_for_its_own_task(job: Job) -> None:
    a, b = job.sites["a"], job.sites["b"]
    frozen = np.arange(N, dtype=np.float32)
    job.send({"frozen": frozen, "w": full(0)})
    a.next_task()  # the server stores the task's arrays as it hands them out
    b.next_task()
    fresh = full(7)
    upload, present = a.grant([checksum_of(fresh), checksum_of(frozen)],
                              [fresh.nbytes, frozen.nbytes]).targets
    # new content: a's own key for this task; content the server stores: present, its key
    assert upload.key == upload_key(job.prefix, a.name, a.task_id, checksum_of(fresh))
    assert upload.url and upload.write_once and not upload.present
    assert (present.key, present.present, present.url) == (
        content_key(job.prefix, checksum_of(frozen)), True, "")

    # a's URL writes a's key and nothing else: the signature covers the key
    b_key = upload_key(job.prefix, b.name, b.task_id, checksum_of(fresh))
    for other in (content_key(job.prefix, checksum_of(fresh)), b_key, present.key):
        for headers in (WRITE_ONCE_HEADERS, None):
            assert http_put(retarget(upload.url, upload.key, other), JUNK, headers) == 403
    assert not job.store.exists(content_key(job.prefix, checksum_of(fresh)))
    assert not job.store.exists(b_key)
    assert job.store.get(present.key) == frozen.tobytes()
    assert http_put(upload.url, fresh.tobytes()) == 403  # signed with its condition: needed
    assert http_put(upload.url, fresh.tobytes(), WRITE_ONCE_HEADERS) == 200

    # no grant for another site's task, nor for anything but a task of a awaiting its result
    for task_id in (b.task_id, "t", ""):
        with pytest.raises(PermissionDenied, match="awaiting its result: no upload grant"):
            job.server.grant_upload(a.name, [checksum_of(fresh)], [fresh.nbytes], task_id)

    # a's own earlier upload of that content: present, at a's key; b has none
    assert a.grant([checksum_of(fresh)], [fresh.nbytes]).targets[0].present
    (b_target,) = b.grant([checksum_of(fresh)], [fresh.nbytes]).targets
    assert (b_target.key, b_target.present) == (b_key, False)
    with pytest.raises(InvalidArgument, match="is not 'blake3:<64 hex digits>'"):
        a.grant(["md5:abc"], [4])

    # once a's result is in, its task takes no more grants
    assert a.send(Dxo(DataKind.WEIGHTS, {"w": fresh})).accepted
    assert a.uploader.bytes_sent == 0  # its object was there already
    with pytest.raises(PermissionDenied, match="no upload grant"):
        a.grant([checksum_of(fresh)], [fresh.nbytes])


def test_a_site_cannot_make_another_site_s_result_fail(job: Job) -> None:
    """The attack of the issue: a asks for a grant of the checksum b will upload and writes
    junk there first. It writes only its own key: b's result is accepted and correct, and what
    a sent fails as a's."""
    a, b = job.sites["a"], job.sites["b"]
    model = {"frozen": np.arange(N, dtype=np.float32), "w": full(0)}
    task = job.send(model)
    a.next_task()
    honest = full(1)  # what b will send: a can guess it
    (target,) = a.grant([checksum_of(honest)], [honest.nbytes]).targets
    assert target.key.startswith(upload_prefix(job.prefix, a.name))
    assert http_put(target.url, JUNK, WRITE_ONCE_HEADERS) == 200
    # a claims b's content at its junk object (which exists, with that length)
    lie = TensorRef(name="w", dtype="float32", shape=(N,), kind=TensorKind.NUMPY,
                    key=target.key, length=honest.nbytes, checksum=checksum_of(honest))
    assert a.submit(a.result(lie)).accepted

    loaded = b.load(b.next_task())
    reply = b.send(Dxo(DataKind.WEIGHTS, {"frozen": loaded.data["frozen"],
                                          "w": loaded.data["w"] + 1}))
    assert (reply.accepted, reply.reason) == (True, "")
    assert b.uploader.bytes_sent == honest.nbytes  # "frozen" is the server's object: present
    sent = job.result_of(task, b)
    assert sent.data["frozen"].key == content_key(job.prefix, checksum_of(model["frozen"]))
    assert sent.data["w"].key == upload_key(job.prefix, b.name, b.task_id, checksum_of(honest))
    np.testing.assert_array_equal(sent.materialized(job.store).data["w"], honest)

    aggregate, failed = job.aggregate((a, job.result_of(task, a)), (b, sent))
    assert list(failed) == [a.name]
    assert f"tensor 'w': bytes from blob {target.key} do not match" in failed[a.name]
    assert failed[a.name].endswith(f"(uploaded by site {a.name})")
    arrays = aggregate.materialized(job.store).data
    np.testing.assert_array_equal(arrays["w"], honest)
    np.testing.assert_array_equal(arrays["frozen"], model["frozen"])


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


def test_a_single_put_url_cannot_rewrite_what_it_wrote(job: Job) -> None:
    """A presigned PUT lives an hour: b tries to write junk over its accepted uploads with the
    URLs it was granted, with the header they were signed with and without it. S3 refuses
    both, so every reader gets what b's result named (in a relay or a cross-site evaluation:
    the next site). A tensor every site sent unchanged, as uploads of their own, becomes the
    server's object, never a site's."""
    a, b = job.sites["a"], job.sites["b"]
    task = job.send({"same": full(0), "w": full(0)})
    same = full(5)  # new content both send: each uploads a copy of its own
    for site, value in ((a, 1.0), (b, 2.0)):
        site.load(site.next_task())
        assert site.send(Dxo(DataKind.WEIGHTS, {"same": same, "w": full(value)})).accepted
    a_result, b_result = job.result_of(task, a), job.result_of(task, b)
    assert a_result.data["same"].key != b_result.data["same"].key

    for name, sent in (("same", same), ("w", full(2))):
        key = b_result.data[name].key
        assert http_put(b.urls[key], JUNK, WRITE_ONCE_HEADERS) == 412  # written already
        assert http_put(b.urls[key], JUNK) == 403  # the condition is signed: it must be sent
        assert job.store.get(key) == sent.tobytes()

    aggregate, failed = job.aggregate((b, b_result), (a, a_result))
    assert failed == {}
    arrays = aggregate.materialized(job.store).data
    np.testing.assert_array_equal(arrays["w"], full(1.5))
    np.testing.assert_array_equal(arrays["same"], same)
    assert aggregate.data["same"].key == content_key(job.prefix, checksum_of(same))


def test_a_retried_single_put_of_the_same_content_is_fine(job: Job) -> None:
    """The PUT's answer was lost and the site sends it again: S3 answers 412 (the key holds
    the object: this site's own upload), which the uploader takes as done."""
    a = job.sites["a"]
    job.send({"w": full(0)}, a)
    a.next_task()
    body = full(9)
    (target,) = a.grant([checksum_of(body)], [body.nbytes]).targets
    assert target.write_once and not target.upload_id
    for _ in range(2):
        a.uploader.put(target.url, target.key, body, headers=WRITE_ONCE_HEADERS)
    assert a.uploader.bytes_sent == body.nbytes  # the second PUT was refused, not counted
    assert job.store.get(target.key) == body.tobytes()
    ref = TensorRef(name="w", dtype="float32", shape=(N,), kind=TensorKind.NUMPY,
                    key=target.key, length=body.nbytes, checksum=checksum_of(body))
    assert a.submit(a.result(ref)).accepted


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


def test_a_multipart_upload_is_write_once(job: Job) -> None:
    """Completed, its part URLs are dead; a second upload the site was granted for the same
    key (two grants before either completed) cannot replace the object."""
    a = job.sites["a"]
    job.send({"w": full(0)}, a)
    a.next_task()
    body = np.arange(2 * MiB, dtype=np.float32)  # 8 MiB: two parts of 5 MiB
    grants = [a.grant([checksum_of(body)], [body.nbytes]).targets[0] for _ in range(2)]
    assert grants[0].key == grants[1].key and grants[0].upload_id != grants[1].upload_id
    raw, junk = body.tobytes(), bytes(body.nbytes)
    for target, data in zip(grants, (raw, junk), strict=True):
        etags = [put_part(url, data[n * 5 * MiB:(n + 1) * 5 * MiB])
                 for n, url in enumerate(target.part_urls)]
        a.complete(target.key, target.upload_id, etags)  # the second: refused by S3, no error
        assert job.store.get(target.key) == raw
    assert http_put(grants[0].part_urls[0], junk[:5 * MiB]) == 404  # no such upload
    with pytest.raises(PermissionDenied, match="no multipart upload"):
        a.complete(grants[1].key, grants[1].upload_id, ["x", "y"])

    # the store's write-once completion on its own
    store = job.store
    again = store.presign_multipart(grants[0].key, 4, 5 * MiB, 60)
    with pytest.raises(AlreadyExists, match="exists already"):
        store.complete_multipart(grants[0].key, again.upload_id,
                                 [put_part(again.urls[0].url, b"four")], write_once=True)
    store.abort_multipart(grants[0].key, again.upload_id)
    assert store.get(grants[0].key) == raw


def put_part(url: str, data: bytes) -> str:
    request = urllib.request.Request(url, data=data, method="PUT")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return str(answer.headers["ETag"])


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
        answer = site.server.get_task(site.name, 200)
        assignment = _A.FromString(answer.body) if isinstance(answer, Encoded) else answer
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
