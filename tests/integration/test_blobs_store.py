"""Contract suite of the blobs port, run against every `blob_store` implementation."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import numpy.typing as npt
import pytest

from fedhive.blobs import BlobLocation, BlobStore, PresignedFetcher
from fedhive.errors import BlobAccessDenied, BlobNotFound, InvalidArgument
from tests.fixtures.infra import wait_for

MiB = 1024 * 1024


def _random(nbytes: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_ensure_bucket_is_idempotent(blob_store: BlobStore, blob_prefix: str) -> None:
    blob_store.ensure_bucket()
    blob_store.ensure_bucket()
    blob_store.put(blob_prefix + "probe", b"ok")
    assert blob_store.get(blob_prefix + "probe") == b"ok"


def test_put_get_exists_size_delete(blob_store: BlobStore, blob_prefix: str) -> None:
    key = blob_prefix + "a/b.bin"
    assert not blob_store.exists(key)
    blob_store.put(key, b"hello world")
    assert blob_store.exists(key)
    assert blob_store.size(key) == 11
    assert blob_store.get(key) == b"hello world"
    blob_store.delete(key)
    assert not blob_store.exists(key)
    blob_store.delete(key)  # deleting a missing key is fine
    blob_store.put(key, b"")
    assert blob_store.size(key) == 0  # no byte to read: S3 is asked for the size itself


def test_delete_takes_many_keys_in_batches(blob_store: BlobStore, blob_prefix: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Many keys go in S3's batch requests (a small batch here, to cross its boundary);
    a missing key among them is fine; keys not named stay."""
    monkeypatch.setattr("fedhive.blobs.s3._DELETE_BATCH", 2)
    keys = [f"{blob_prefix}many/{i}" for i in range(5)]
    for key in keys:
        blob_store.put(key, b"x")
    blob_store.delete(*keys[:4], f"{blob_prefix}many/missing")
    assert [blob_store.exists(key) for key in keys] == [False] * 4 + [True]
    blob_store.delete()  # nothing to delete: no request


def test_put_streams_several_buffers_as_one_object(blob_store: BlobStore, blob_prefix: str) -> None:
    parts = [b"abc", bytearray(b""), memoryview(b"defg"), np.arange(3, dtype=np.uint8)]
    blob_store.put(blob_prefix + "joined", parts)  # type: ignore[arg-type]
    assert blob_store.get(blob_prefix + "joined") == b"abcdefg\x00\x01\x02"


def test_missing_key_raises_blob_not_found_naming_it(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "never-written"
    with pytest.raises(BlobNotFound, match=key):
        blob_store.get(key)
    with pytest.raises(BlobNotFound, match=key):
        blob_store.read_into(key, memoryview(bytearray(10)))
    with pytest.raises(BlobNotFound, match=key):
        blob_store.size(key)


def test_large_object_goes_multipart_and_reads_back_in_parallel_ranges(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "large"
    data = _random(40 * MiB + 12345)  # above the 16 MiB multipart threshold: 6 parts
    blob_store.put(key, [data[: 7 * MiB].data, data[7 * MiB :].data])
    assert blob_store.size(key) == data.nbytes
    dest = np.empty(data.nbytes, dtype=np.uint8)
    blob_store.read_into(key, dest.data)
    assert np.array_equal(dest, data)
    window = np.empty(3 * MiB, dtype=np.uint8)
    blob_store.read_into(key, window.data, offset=20 * MiB + 1)
    assert np.array_equal(window, data[20 * MiB + 1 : 23 * MiB + 1])


def test_range_outside_the_object_is_an_error_not_zeros(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "short"
    blob_store.put(key, b"0123456789")
    with pytest.raises(InvalidArgument, match=key):
        blob_store.read_into(key, memoryview(bytearray(8)), offset=5)


def test_delete_prefix_removes_only_that_prefix(blob_store: BlobStore, blob_prefix: str) -> None:
    for i in range(5):
        blob_store.put(f"{blob_prefix}gone/{i}", b"x")
    blob_store.put(f"{blob_prefix}kept", b"y")
    assert blob_store.delete_prefix(f"{blob_prefix}gone/") == 5
    assert not blob_store.exists(f"{blob_prefix}gone/0")
    assert blob_store.exists(f"{blob_prefix}kept")
    with pytest.raises(InvalidArgument):
        blob_store.delete_prefix("")


def test_presigned_get_works_with_no_credentials_in_a_clean_process(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "public"
    blob_store.put(key, b"readable by url alone")
    url = blob_store.presign_get(key, expires_in=300).url
    script = (
        "import sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1], headers={'Range': 'bytes=9-10'})\n"
        "print(urllib.request.urlopen(req).read().decode())\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # no AWS_* variables, no config files
    done = subprocess.run(
        [sys.executable, "-c", script, url], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "by"


def test_presigned_fetcher_reads_ranges_into_buffers(
    blob_store: BlobStore, blob_prefix: str, presigned_fetcher: PresignedFetcher
) -> None:
    key = blob_prefix + "ranged"
    data = _random(3 * MiB, seed=1)
    blob_store.put(key, data.data)
    where = BlobLocation(key, blob_store.presign_get(key, expires_in=300).url)
    first, second = np.empty(1000, np.uint8), np.empty(2 * MiB, np.uint8)
    presigned_fetcher.fetch_range(where, 17, [first.data, second.data])
    assert np.array_equal(first, data[17:1017])
    assert np.array_equal(second, data[1017 : 1017 + 2 * MiB])


def test_presigned_put_uploads_without_credentials(
    blob_store: BlobStore, blob_prefix: str, presigned_fetcher: PresignedFetcher
) -> None:
    key = blob_prefix + "uploaded-by-url"
    grant = blob_store.presign_put(key, expires_in=300)
    presigned_fetcher.put(grant.url, key, [b"from ", b"a trainer"])
    assert blob_store.get(key) == b"from a trainer"


def _tamper(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(changes)
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_tampered_and_forged_urls_are_denied_naming_the_key(
    blob_store: BlobStore, blob_prefix: str, presigned_fetcher: PresignedFetcher
) -> None:
    key, other = blob_prefix + "guarded", blob_prefix + "other"
    blob_store.put(key, b"secret")
    blob_store.put(other, b"another")
    url = blob_store.presign_get(key, expires_in=300).url
    signature = dict(parse_qsl(urlsplit(url).query))["X-Amz-Signature"]
    flipped = ("0" if signature[0] != "0" else "1") + signature[1:]
    forged_paths = [
        _tamper(url, **{"X-Amz-Signature": flipped}),  # tampered signature
        _tamper(url, **{"X-Amz-Expires": "604800"}),  # longer life than signed
        url.replace("/guarded?", "/other?"),  # the signature of one key used for another
    ]
    for forged in forged_paths:
        with pytest.raises(BlobAccessDenied) as caught:
            presigned_fetcher.fetch_range(BlobLocation(key, forged), 0, [memoryview(bytearray(3))])
        assert key in str(caught.value)
        assert "signature does not match" in str(caught.value)


def test_expired_url_is_denied(
    blob_store: BlobStore, blob_prefix: str, presigned_fetcher: PresignedFetcher
) -> None:
    key = blob_prefix + "short-lived"
    blob_store.put(key, b"soon gone")
    where = BlobLocation(key, blob_store.presign_get(key, expires_in=1).url)
    failures: list[BlobAccessDenied] = []

    def denied() -> bool:
        try:
            presigned_fetcher.fetch_range(where, 0, [memoryview(bytearray(4))])
        except BlobAccessDenied as err:
            failures.append(err)
            return True
        return False

    wait_for(denied, timeout=30, interval=0.25, what="the presigned URL to expire")
    assert "expired" in str(failures[0])
    assert key in str(failures[0])


def test_url_for_a_missing_key_is_not_found(
    blob_store: BlobStore, blob_prefix: str, presigned_fetcher: PresignedFetcher
) -> None:
    key = blob_prefix + "absent"
    where = BlobLocation(key, blob_store.presign_get(key, expires_in=300).url)
    with pytest.raises(BlobNotFound, match=key):
        presigned_fetcher.fetch_range(where, 0, [memoryview(bytearray(4))])


def test_presign_expiry_bounds(blob_store: BlobStore, blob_prefix: str) -> None:
    grant = blob_store.presign_get(blob_prefix + "x", expires_in=60)
    assert json.dumps(grant.expires_at_ms).isdigit()
    with pytest.raises(InvalidArgument):
        blob_store.presign_get(blob_prefix + "x", expires_in=0)
    with pytest.raises(InvalidArgument):
        blob_store.presign_put(blob_prefix + "x", expires_in=8 * 24 * 3600)
