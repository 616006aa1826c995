"""Upload grants are scoped to the site and its task (issue #16 point 2), on real S3: a site is
granted only its own keys for its own task, writes nothing else with them, cannot make another
site's result fail, and cannot rewrite what it uploaded (single PUTs and multipart uploads are
write-once).

The job, its sites and how they act: tests/fixtures/uploads.py. A misbehaving site uses raw
HTTP with the URLs it was granted. What a result, a model or another site may name and read:
test_upload_scoping_references.py.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping

import numpy as np
import pytest

from fedhive.blobs import WRITE_ONCE_HEADERS, TensorKind, TensorRef, content_key
from fedhive.blobs.keys import upload_key, upload_prefix
from fedhive.errors import AlreadyExists, InvalidArgument, PermissionDenied
from fedhive.fl.dxo import DataKind, Dxo
from tests.fixtures.uploads import JUNK, Job, MiB, N, checksum_of, full
from tests.fixtures.uploads import job as job


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
    # a server object the task did not hand the site is not looked for: the site uploads its own
    elsewhere = full(11)
    job.store.put(content_key(job.prefix, checksum_of(elsewhere)), [elsewhere.tobytes()])
    (own,) = a.grant([checksum_of(elsewhere)], [elsewhere.nbytes]).targets
    assert (own.key, own.present) == (
        upload_key(job.prefix, a.name, a.task_id, checksum_of(elsewhere)), False)

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
