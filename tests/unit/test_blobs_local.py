"""The local blob store's own rules (the port's contract runs in tests/integration/
test_blobs_store.py and test_blobs_presigned.py): keys stay inside its folder, URL signatures
cover everything a URL allows and expire, S3's answers for ranges, multipart refusals, writes
that are all or nothing, and URLs that die with the store."""

from __future__ import annotations

import http.client
import io
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from fedhive.blobs import (
    BlobLocation,
    LocalBlobStore,
    PresignedFetcher,
    PresignedUploader,
    PresignedUrl,
)
from fedhive.blobs.failures import parse_error_document
from fedhive.blobs.local_http import Refusal, Signer, byte_range
from fedhive.errors import (
    AlreadyExists,
    BlobAccessDenied,
    BlobNotFound,
    InvalidArgument,
    Unavailable,
)
from fedhive.retry import Backoff
from tests.fixtures.infra import wait_for

MiB = 1024 * 1024
ONCE = Backoff(max_attempts=1)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalBlobStore]:
    local = LocalBlobStore(tmp_path / "root", bucket="bucket")
    local.ensure_bucket()
    yield local
    local.close()


@pytest.fixture
def fetcher() -> Iterator[PresignedFetcher]:
    reader = PresignedFetcher(backoff=ONCE)
    yield reader
    reader.close()


def _read(fetcher: PresignedFetcher, key: str, url: str, size: int, offset: int = 0) -> bytes:
    dest = bytearray(size)
    fetcher.fetch_range(BlobLocation(key, url), offset, [memoryview(dest)])
    return bytes(dest)


def _request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
             body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=10)
    try:
        conn.request(method, f"{parts.path}?{parts.query}", body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        conn.close()


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/", "./a", "a/../../escape", "..",
                                 "nul\0byte", "k" * 1025, "a/" + "s" * 256])
def test_keys_a_folder_cannot_hold_are_refused_naming_them(
    store: LocalBlobStore, tmp_path: Path, key: str
) -> None:
    for attempt in (lambda: store.put(key, b"x"), lambda: store.presign_get(key, 60),
                    lambda: store.get(key), lambda: store.presign_multipart(key, 10, 1, 60)):
        with pytest.raises(InvalidArgument) as caught:
            attempt()
        assert repr(key)[:40] in str(caught.value)
    assert not (tmp_path / "escape").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_an_object_cannot_also_be_a_folder_until_its_children_are_deleted(
    store: LocalBlobStore,
) -> None:
    store.put("a/b/c", b"child")
    with pytest.raises(InvalidArgument, match="a local folder cannot hold"):
        store.put("a/b", b"parent")
    with pytest.raises(BlobNotFound, match="a/b"):
        store.get("a/b")  # a folder is no object
    with pytest.raises(InvalidArgument, match="a local folder cannot hold"):
        store.put("a/b/c/d", b"grandchild")
    store.delete("a/b/c")
    store.put("a/b", b"parent")  # the emptied folders went with it
    assert store.get("a/b") == b"parent"


def test_delete_prefix_is_a_string_prefix_and_prunes_empty_folders(
    store: LocalBlobStore, tmp_path: Path
) -> None:
    for key in ("ns/gone/0", "ns/gone/deep/1", "ns/good", "ns/bad", "other/go"):
        store.put(key, b"x")
    assert store.delete_prefix("ns/go") == 3
    assert [store.exists(k) for k in ("ns/good", "ns/bad", "other/go")] == [False, True, True]
    assert store.delete_prefix("missing/") == 0
    assert store.delete_prefix("ns/../") == 0  # no key is under it: nothing leaves the root
    with pytest.raises(InvalidArgument, match="empty prefix"):
        store.delete_prefix("")
    folders = sorted(p.relative_to(tmp_path / "root/objects").as_posix()
                     for p in (tmp_path / "root/objects").rglob("*") if p.is_dir())
    assert folders == ["ns", "other"]


def test_put_file_stores_the_whole_file_streamed(store: LocalBlobStore) -> None:
    data = bytes(range(256)) * (9 * MiB // 256 + 7)
    file = io.BytesIO(data)
    file.seek(1234)
    store.put_file("big/file", file)
    assert store.size("big/file") == len(data) and store.get("big/file") == data


def test_a_signature_is_bound_to_method_path_fields_headers_and_its_signer() -> None:
    signer = Signer()
    before = int(time.time())
    query, expires_at_ms = signer.sign("GET", "127.0.0.1:1", "/b/k", 60, {}, {})
    now = time.time()
    assert before <= expires_at_ms // 1000 - 60 <= now  # signed then, for 60 s
    signer.check("GET", "/b/k", query, {"host": "127.0.0.1:1"}.get, now)
    altered = [
        ("PUT", "/b/k", query, {"host": "127.0.0.1:1"}),  # another method
        ("GET", "/b/other", query, {"host": "127.0.0.1:1"}),  # another key
        ("GET", "/b/k", query + "&partNumber=1", {"host": "127.0.0.1:1"}),  # a field added
        ("GET", "/b/k", query, {"host": "localhost:1"}),  # another host
    ]
    for method, path, used, headers in altered:
        with pytest.raises(Refusal) as caught:
            signer.check(method, path, used, headers.get, now)
        assert (caught.value.status, caught.value.code) == (403, "SignatureDoesNotMatch")
    with pytest.raises(Refusal, match="SignatureDoesNotMatch"):
        Signer().check("GET", "/b/k", query, {"host": "127.0.0.1:1"}.get, now)  # its own key
    with pytest.raises(Refusal) as missing:
        signer.check("GET", "/b/k", query.replace("X-Amz-Date", "X-Amz-Dat"),
                     {"host": "127.0.0.1:1"}.get, now)
    assert missing.value.code == "AuthorizationQueryParametersError"


def test_a_signature_expires_when_its_lifetime_is_over() -> None:
    signer = Signer()
    query, expires_at_ms = signer.sign("PUT", "h", "/b/k", 30, {"if-none-match": "*"}, {})
    headers = {"host": "h", "if-none-match": "*"}.get
    signer.check("PUT", "/b/k", query, headers, expires_at_ms / 1000)  # its last second
    with pytest.raises(Refusal) as caught:
        signer.check("PUT", "/b/k", query, headers, expires_at_ms / 1000 + 1)
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        403, "AccessDenied", "Request has expired")
    with pytest.raises(Refusal, match="SignatureDoesNotMatch"):  # the header is signed
        signer.check("PUT", "/b/k", query, {"host": "h"}.get, expires_at_ms / 1000)


@pytest.mark.parametrize(("header", "size", "span"), [
    (None, 10, None), ("bytes=2-4", 10, (2, 5)), ("bytes=5-", 10, (5, 10)),
    ("bytes=8-99", 10, (8, 10)), ("bytes=-3", 10, (7, 10)), ("bytes=-30", 10, (0, 10)),
    ("bytes=4-2", 10, None), ("bytes=0-1,4-5", 10, None), ("items=0-1", 10, None),
])
def test_range_headers_read_as_s3_reads_them(
    header: str | None, size: int, span: tuple[int, int] | None
) -> None:
    assert byte_range(header, size) == span


@pytest.mark.parametrize(("header", "size"), [("bytes=10-", 10), ("bytes=-0", 10),
                                              ("bytes=0-", 0)])
def test_unsatisfiable_ranges_are_416(header: str, size: int) -> None:
    with pytest.raises(Refusal) as caught:
        byte_range(header, size)
    assert caught.value.status == 416
    assert caught.value.headers == {"Content-Range": f"bytes */{size}"}


def test_urls_answer_as_s3_does(store: LocalBlobStore, fetcher: PresignedFetcher) -> None:
    store.put("k", b"0123456789")
    url = store.presign_get("k", 60).url
    assert url.startswith(store.url_prefix() + "/k?") and store.url_prefix().endswith("/bucket")
    status, headers, body = _request(url, headers={"Range": "bytes=7-"})
    assert (status, headers["Content-Range"], body) == (206, "bytes 7-9/10", b"789")
    status, headers, body = _request(url, headers={"Range": "bytes=10-"})
    assert (status, parse_error_document(body)[0]) == (416, "InvalidRange")
    status, _, body = _request(url, "PUT", body=b"x")  # a GET URL used to write
    assert (status, parse_error_document(body)[0]) == (403, "SignatureDoesNotMatch")
    with pytest.raises(InvalidArgument, match="server sent 3 bytes"):
        _read(fetcher, "k", url, 5, offset=7)
    status, _, body = _request(url.split("?")[0])  # no signature at all
    assert (status, parse_error_document(body)[0]) == (400, "AuthorizationQueryParametersError")
    with pytest.raises(BlobAccessDenied, match="k: access denied"):
        _read(fetcher, "k", url.split("?")[0] + "?X-Amz-Signature=0", 1)


def test_a_refused_put_keeps_the_connection_usable(store: LocalBlobStore) -> None:
    refused = store.presign_get("k", 60).url  # the body of a refused PUT is read and dropped
    allowed = store.presign_put("k", 60).url
    parts = urlsplit(refused)
    conn = http.client.HTTPConnection(parts.netloc, timeout=10)
    for url, expected in ((refused, 403), (allowed, 200)):
        target = urlsplit(url)
        conn.request("PUT", f"{target.path}?{target.query}", body=b"z" * 100_000)
        answer = conn.getresponse()
        answer.read()
        assert answer.status == expected
    conn.close()
    assert store.get("k") == b"z" * 100_000


def test_a_put_cut_off_mid_body_leaves_nothing(store: LocalBlobStore, tmp_path: Path) -> None:
    url = urlsplit(store.presign_put("cut", 60).url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(f"PUT {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                     "Content-Length: 1000\r\n\r\n".encode() + b"x" * 10)
    wait_for(lambda: not any((tmp_path / "root/tmp").iterdir()), what="the partial file to go")
    assert not store.exists("cut")


def test_multipart_refusals_are_s3s(store: LocalBlobStore) -> None:
    uploader = PresignedUploader(backoff=ONCE)
    data = bytes(11 * MiB)
    grant = store.presign_multipart("mp", len(data), 5 * MiB, 60)
    etags = uploader.put_parts(grant, "mp", data)
    with pytest.raises(InvalidArgument, match="InvalidPart"):
        store.complete_multipart("mp", grant.upload_id, [etags[0], etags[2], etags[1]])
    with pytest.raises(InvalidArgument, match="no such multipart upload"):
        store.complete_multipart("other", grant.upload_id, etags)  # the upload of another key
    store.put("mp", b"first")
    with pytest.raises(AlreadyExists, match="mp"):
        store.complete_multipart("mp", grant.upload_id, etags, write_once=True)
    assert store.get("mp") == b"first"
    store.complete_multipart("mp", grant.upload_id, [e.strip('"') for e in etags])  # unquoted
    assert store.get("mp") == data
    with pytest.raises(InvalidArgument, match="no such multipart upload"):
        uploader.put_parts(grant, "mp", data)  # a completed upload takes no more parts

    small = store.presign_multipart("small", 11 * MiB, 5 * MiB, 60)
    part = _request(small.urls[0].url, "PUT", body=b"tiny")[1]["ETag"]
    last = _request(small.urls[1].url, "PUT", body=b"end")[1]["ETag"]
    with pytest.raises(InvalidArgument, match="EntityTooSmall: part 1"):
        store.complete_multipart("small", small.upload_id, [part, last])
    store.abort_multipart("small", small.upload_id)
    store.abort_multipart("small", small.upload_id)  # unknown now: no error
    uploader.close()


def test_urls_die_with_the_store_and_objects_outlive_it(
    tmp_path: Path, fetcher: PresignedFetcher
) -> None:
    first = LocalBlobStore(tmp_path, bucket="bucket")
    first.ensure_bucket()
    first.put("kept", b"kept bytes")
    url = first.presign_get("kept", 60).url
    assert _read(fetcher, "kept", url, 4) == b"kept"  # the fetcher keeps the connection
    first.close()
    with pytest.raises(Unavailable, match="kept"):
        _read(fetcher, "kept", url, 4)  # neither that connection nor a new one answers
    second = LocalBlobStore(tmp_path, bucket="bucket")
    try:
        assert second.get("kept") == b"kept bytes"
        renewed = second.presign_get("kept", 60)
        assert isinstance(renewed, PresignedUrl) and renewed.url != url
        assert _read(fetcher, "kept", renewed.url, 5, offset=5) == b"bytes"
    finally:
        second.close()
