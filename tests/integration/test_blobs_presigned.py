"""Presigned transfers against real S3: multipart uploads by a process without credentials,
per-part retries, URLs re-signed through a callback, and URLs signed for a public endpoint."""

from __future__ import annotations

import dataclasses
import time
from urllib.parse import parse_qs, urlsplit

import numpy as np
import numpy.typing as npt
import pytest

from fedhive.blobs import (
    WRITE_ONCE_HEADERS,
    BlobLocation,
    BlobStore,
    PresignedFetcher,
    PresignedUploader,
    PresignedUrl,
    S3BlobStore,
    TensorCodec,
    unpack,
)
from fedhive.config import Settings
from fedhive.errors import BlobAccessDenied, BlobNotFound, InvalidArgument, Unavailable
from fedhive.retry import Backoff
from tests.fixtures.infra import wait_for
from tests.fixtures.s3_proxy import S3Proxy

MiB = 1024 * 1024
QUICK = Backoff(base=0.01, cap=0.05, max_attempts=3)


def _random(nbytes: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _part_number(target: str) -> int:
    return int(parse_qs(urlsplit(target).query).get("partNumber", ["0"])[0])


@pytest.fixture
def uploader() -> PresignedUploader:
    return PresignedUploader(backoff=QUICK, workers=4)


def test_multipart_upload_through_presigned_part_urls_is_bit_exact(
    blob_store: BlobStore, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "multipart"
    data = _random(20 * MiB + 12345, seed=1)
    grant = blob_store.presign_multipart(key, data.nbytes, 5 * MiB, expires_in=300)
    assert grant.part_size == 5 * MiB and len(grant.urls) == 5
    assert not blob_store.exists(key)
    etags = uploader.put_parts(grant, key, [data[: 3 * MiB], data[3 * MiB :]])  # any buffers
    assert len(etags) == 5 and all(etags)
    assert not blob_store.exists(key)  # nothing is visible before completion
    blob_store.complete_multipart(key, grant.upload_id, etags)
    assert blob_store.size(key) == data.nbytes
    back = np.empty(data.nbytes, dtype=np.uint8)
    blob_store.read_into(key, back.data)
    assert np.array_equal(back, data)
    assert uploader.bytes_sent == data.nbytes
    uploader.close()


def test_part_size_is_raised_to_the_s3_minimum(blob_store: BlobStore, blob_prefix: str) -> None:
    key = blob_prefix + "tiny-parts"
    grant = blob_store.presign_multipart(key, 11 * MiB, 1024, expires_in=60)
    assert grant.part_size == 5 * MiB and len(grant.urls) == 3
    blob_store.abort_multipart(key, grant.upload_id)
    with pytest.raises(InvalidArgument, match="size"):
        blob_store.presign_multipart(key, 0, 5 * MiB, expires_in=60)


def test_a_part_that_fails_once_is_retried_alone(
    public_store: S3BlobStore, s3_proxy: S3Proxy, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "flaky"
    data = _random(12 * MiB, seed=2)
    grant = public_store.presign_multipart(key, data.nbytes, 5 * MiB, expires_in=300)
    failed: list[int] = []

    def fail_part_two_once(method: str, target: str) -> int | None:
        if method == "PUT" and _part_number(target) == 2 and not failed:
            failed.append(2)
            return 503
        return None

    s3_proxy.fault = fail_part_two_once
    etags = uploader.put_parts(grant, key, data)
    public_store.complete_multipart(key, grant.upload_id, etags)
    assert public_store.get(key) == data.tobytes()
    puts = sorted(_part_number(t) for m, t, _ in s3_proxy.requests if m == "PUT")
    assert puts == [1, 2, 2, 3]  # only part 2 went twice
    assert [s for m, t, s in s3_proxy.requests if _part_number(t) == 2] == [503, 200]
    uploader.close()


def test_a_part_that_keeps_failing_fails_the_upload_and_abort_drops_it(
    public_store: S3BlobStore, s3_proxy: S3Proxy, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "broken"
    data = _random(11 * MiB, seed=3)
    grant = public_store.presign_multipart(key, data.nbytes, 5 * MiB, expires_in=300)
    s3_proxy.fault = lambda method, target: 503 if _part_number(target) == 3 else None
    with pytest.raises(Unavailable, match=key):
        uploader.put_parts(grant, key, data)
    assert sum(1 for _, t, _ in s3_proxy.requests if _part_number(t) == 3) == QUICK.max_attempts
    public_store.abort_multipart(key, grant.upload_id)
    public_store.abort_multipart(key, grant.upload_id)  # twice: no error
    assert not public_store.exists(key)
    with pytest.raises(InvalidArgument, match="no such multipart upload"):
        public_store.complete_multipart(key, grant.upload_id, ["\"etag\""] * 3)
    uploader.close()


def test_grant_and_body_must_agree(
    blob_store: BlobStore, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "mismatch"
    grant = blob_store.presign_multipart(key, 10 * MiB, 5 * MiB, expires_in=60)
    with pytest.raises(InvalidArgument, match="part URLs"):
        uploader.put_parts(grant, key, _random(11 * MiB))  # needs 3 parts, granted 2
    with pytest.raises(InvalidArgument, match="ETags"):
        blob_store.complete_multipart(key, grant.upload_id, [])
    blob_store.abort_multipart(key, grant.upload_id)
    uploader.close()


def test_single_put_through_the_uploader(
    blob_store: BlobStore, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "single"
    uploader.put(blob_store.presign_put(key, 60).url, key, [b"one ", memoryview(b"object")])
    assert blob_store.get(key) == b"one object"
    assert uploader.bytes_sent == 10
    uploader.close()


def test_a_write_once_put_url_writes_its_key_once(
    blob_store: BlobStore, blob_prefix: str, uploader: PresignedUploader
) -> None:
    key = blob_prefix + "once"
    url = blob_store.presign_put(key, 60, write_once=True).url
    with pytest.raises(BlobAccessDenied, match="signature does not match"):
        uploader.put(url, key, b"no header")  # the condition is signed: it cannot be dropped
    assert not blob_store.exists(key)
    uploader.put(url, key, b"first", headers=WRITE_ONCE_HEADERS)
    uploader.put(url, key, b"first", headers=WRITE_ONCE_HEADERS)  # a retry: 412, taken as done
    uploader.put(url, key, b"other", headers=WRITE_ONCE_HEADERS)  # nor can it write another
    assert blob_store.get(key) == b"first"
    assert uploader.bytes_sent == 5
    with pytest.raises(BlobAccessDenied):
        uploader.put(url, key, b"other")
    assert blob_store.get(key) == b"first"

    # without write_once, a presigned PUT may overwrite
    uploader.put(blob_store.presign_put(key, 60).url, key, b"again")
    assert blob_store.get(key) == b"again"
    uploader.close()


def test_public_endpoint_signs_urls_for_the_sites_address(
    public_store: S3BlobStore, s3_proxy: S3Proxy, settings: Settings, blob_prefix: str
) -> None:
    key = blob_prefix + "public"
    data = _random(3 * MiB, seed=4)
    public_store.put(key, data.data)  # credentialed calls go straight to S3
    assert s3_proxy.requests == []
    url = public_store.presign_get(key, 60)
    assert url.url.startswith(s3_proxy.url + "/")
    assert settings.s3_endpoint_url is not None
    assert not url.url.startswith(settings.s3_endpoint_url + "/")
    fetcher = PresignedFetcher()
    dest = np.empty(data.nbytes, dtype=np.uint8)
    fetcher.fetch_range(BlobLocation(key, url.url), 0, [dest.data])
    assert np.array_equal(dest, data)
    assert s3_proxy.bytes_out == data.nbytes and fetcher.bytes_fetched == data.nbytes
    fetcher.close()


def test_default_store_signs_for_the_endpoint(
    blob_store: BlobStore, settings: Settings, blob_prefix: str
) -> None:
    assert settings.s3_endpoint_url is not None
    assert blob_store.presign_get(blob_prefix + "x", 60).url.startswith(settings.s3_endpoint_url)


class Resigner:
    """The SJ's side of `ResignRequest`: records each call, signs with the store."""

    def __init__(self, store: BlobStore, ttl: int = 300) -> None:
        self.store, self.ttl = store, ttl
        self.calls: list[list[str]] = []

    def __call__(self, keys: list[str]) -> dict[str, PresignedUrl]:
        self.calls.append(list(keys))
        return {key: self.store.presign_get(key, self.ttl) for key in keys}


def test_an_expired_url_is_resigned_through_the_callback(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "short-lived"
    blob_store.put(key, b"still readable")
    expired = BlobLocation(key, blob_store.presign_get(key, expires_in=1).url)  # expiry unknown
    plain = PresignedFetcher(backoff=QUICK)

    def refused() -> bool:
        try:
            plain.fetch_range(expired, 0, [memoryview(bytearray(5))])
        except BlobAccessDenied:
            return True
        return False

    wait_for(refused, timeout=30, interval=0.25, what="the presigned URL to expire")
    resign = Resigner(blob_store)
    fetcher = PresignedFetcher(backoff=QUICK, resign=resign)
    dest = bytearray(8)
    fetcher.fetch_range(expired, 6, [memoryview(dest)])  # 403, then re-signed once
    assert bytes(dest) == b"readable"
    assert resign.calls == [[key]]
    fetcher.fetch_range(expired, 0, [memoryview(dest)])  # the fresh URL is kept: no new call
    assert resign.calls == [[key]] and fetcher.urls_resigned == 1
    plain.close()
    fetcher.close()


def test_a_url_near_expiry_or_missing_is_renewed_before_use(
    blob_store: BlobStore, blob_prefix: str, s3_proxy: S3Proxy
) -> None:
    key = blob_prefix + "renewed"
    blob_store.put(key, b"0123456789")
    resign = Resigner(blob_store)
    fetcher = PresignedFetcher(resign=resign, resign_margin_s=120)
    soon = int(time.time() * 1000) + 30_000  # valid, but inside the margin
    proxied = BlobLocation(key, s3_proxy.url + "/never-used", soon)
    dest = bytearray(4)
    fetcher.fetch_range(proxied, 3, [memoryview(dest)])
    assert bytes(dest) == b"3456"
    assert resign.calls == [[key]] and s3_proxy.requests == []  # the old URL was never tried
    other = blob_prefix + "no-url"
    blob_store.put(other, b"abc")
    fetcher.fetch_range(BlobLocation(other), 0, [memoryview(dest)[:3]])  # a ref without URL
    assert bytes(dest[:3]) == b"abc" and resign.calls[-1] == [other]
    fetcher.close()


def test_a_fetcher_keeps_the_newest_urls_and_reads_sizes_through_them(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    """`length` reads an object's size through its GET URL (signed once, then used by the read
    too); `keep_urls` bounds the URLs kept, the oldest going first."""
    keys = [f"{blob_prefix}kept/{i}" for i in range(3)]
    for i, key in enumerate(keys):
        blob_store.put(key, b"x" * (i + 1))
    resign = Resigner(blob_store)
    fetcher = PresignedFetcher(resign=resign, keep_urls=2)
    assert [fetcher.length(BlobLocation(key)) for key in keys] == [1, 2, 3]
    dest = bytearray(3)
    fetcher.fetch_range(BlobLocation(keys[2]), 0, [memoryview(dest)])  # its URL is kept
    fetcher.fetch_range(BlobLocation(keys[0]), 0, [memoryview(dest)[:1]])  # its was dropped
    assert resign.calls == [[keys[0]], [keys[1]], [keys[2]], [keys[0]]]
    with pytest.raises(BlobNotFound):
        fetcher.length(BlobLocation(blob_prefix + "kept/missing"))
    fetcher.close()


def test_unpack_renews_all_expiring_urls_in_one_call(
    blob_store: BlobStore, settings: Settings, tensor_prefix: str
) -> None:
    codec = TensorCodec(blob_store, settings, inline_threshold=0)
    model = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(5)}
    refs = codec.pack(model, tensor_prefix)
    past = int(time.time() * 1000) - 1
    stale = [dataclasses.replace(ref, url_expires_at_ms=past) for ref in refs]
    resign = Resigner(blob_store)
    fetcher = PresignedFetcher(resign=resign)
    back = unpack(stale, fetcher)
    assert all(np.array_equal(back[name], value) for name, value in model.items())
    assert resign.calls == [sorted(ref.key for ref in refs)]
    codec.close()
    fetcher.close()


def test_a_url_still_refused_after_resigning_is_access_denied(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    key = blob_prefix + "denied"
    blob_store.put(key, b"x")
    forged = blob_store.presign_get(key, 300).url.replace("X-Amz-Signature=", "X-Amz-Signature=0")

    def resign_badly(keys: list[str]) -> dict[str, PresignedUrl]:
        return {k: PresignedUrl(forged, int(time.time() * 1000) + 300_000) for k in keys}

    fetcher = PresignedFetcher(backoff=QUICK, resign=resign_badly)
    with pytest.raises(BlobAccessDenied, match=key):
        fetcher.fetch_range(BlobLocation(key, forged), 0, [memoryview(bytearray(1))])
    silent = PresignedFetcher(resign=lambda keys: {})
    with pytest.raises(BlobAccessDenied, match="no URL"):
        silent.fetch_range(BlobLocation(key), 0, [memoryview(bytearray(1))])
    fetcher.close()
    silent.close()



def test_skewed_clocks_do_not_cost_a_resign_per_read(
    blob_store: BlobStore, blob_prefix: str
) -> None:
    """A site whose clock runs an hour ahead sees every URL as expired: it renews each key
    once, then uses what it got until S3 itself refuses it."""
    key = blob_prefix + "skewed"
    blob_store.put(key, b"0123456789")
    calls: list[list[str]] = []

    def resign(keys: list[str]) -> dict[str, PresignedUrl]:
        calls.append(keys)
        return {k: PresignedUrl(blob_store.presign_get(k, 300).url, 1) for k in keys}  # "past"

    fetcher = PresignedFetcher(resign=resign)
    dest = bytearray(2)
    for offset in range(4):
        fetcher.fetch_range(BlobLocation(key, "", 1), offset, [memoryview(dest)])
        assert bytes(dest) == b"0123456789"[offset : offset + 2]
    assert calls == [[key]]
    fetcher.close()
